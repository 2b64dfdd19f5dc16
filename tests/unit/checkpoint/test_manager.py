import pytest

from mlrl.checkpoint.manager import CheckpointManager, read_state
from mlrl.ckpt_files.errors import CheckpointError


def _save(m, step, payload="x"):
    tmp = m.begin(step)
    (tmp / "model_optim").mkdir()
    (tmp / "model_optim" / "w").write_text(payload)
    return m.commit(tmp, step, {"weight_version": step})


def test_commit_latest_and_keep_last(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for s in (2, 4, 6):
        _save(m, s)
    assert [p.name for p in m.complete_checkpoints()] == ["step_000004", "step_000006"]
    assert m.latest().name == "step_000006"
    assert read_state(m.latest()) == {"step": 6, "weight_version": 6}


def test_interrupted_save_is_never_picked(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=0)
    _save(m, 2)
    tmp = m.begin(4)  # "killed" before commit: no COMPLETE, still a temp name
    (tmp / "model_optim").mkdir()
    assert m.latest().name == "step_000002"
    # a folder renamed into place without COMPLETE (impossible through commit) is ignored too
    (tmp_path / "step_000008").mkdir()
    assert m.latest().name == "step_000002"
    with pytest.raises(CheckpointError, match="incomplete"):
        m.resolve_resume(str(tmp_path / "step_000008"))
    # the next successful save cleans the stale temporary folder
    _save(m, 6)
    assert not list(tmp_path.glob(".tmp-*"))


def test_stale_latest_pointer_falls_back(tmp_path):
    m = CheckpointManager(tmp_path)
    _save(m, 2)
    (tmp_path / "latest").write_text("step_000099\n")
    assert m.latest().name == "step_000002"


def test_a_crash_between_the_rename_and_the_pointer_resumes_the_newest(tmp_path):
    """commit renames step_N into place, then moves `latest`: killed in between, the pointer names
    step_N-1. resume=auto takes step_N (and the run may start: nothing is newer than it)."""
    m = CheckpointManager(tmp_path)
    _save(m, 1)
    _save(m, 2)
    _save(m, 3)
    (tmp_path / "latest").write_text("step_000002\n")  # the pointer one behind
    assert m.resolve_resume("auto").name == "step_000003"
    m.check_start(3)


def test_resolve_resume(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    assert m.resolve_resume("auto") is None and m.resolve_resume("none") is None
    with pytest.raises(CheckpointError, match="does not exist"):
        m.resolve_resume(str(tmp_path / "nope"))
    _save(m, 3)
    assert m.resolve_resume(str(tmp_path / "ck")).name == "step_000003"
    assert m.resolve_resume(str(tmp_path / "ck" / "step_000003")).name == "step_000003"
    # a root without its `latest` pointer (killed before the first pointer write, or copied by
    # hand): its complete folders decide, as for resume=auto
    _save(m, 5)
    (tmp_path / "ck" / "latest").unlink()
    assert m.resolve_resume(str(tmp_path / "ck")).name == "step_000005"


def test_a_run_folder_or_another_folder_is_named_as_such(tmp_path):
    """checkpoint.resume=runs/foo (the run, not its checkpoints/) was reported as an interrupted save."""
    run = tmp_path / "run"
    m = CheckpointManager(run / "checkpoints")
    _save(m, 2)
    with pytest.raises(CheckpointError, match=r"is a run folder; name its checkpoints: checkpoint.resume=.*/run/"
                                              r"checkpoints \(or one step_N folder in it\)"):
        m.resolve_resume(str(run))
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match="is neither a checkpoint"):
        m.resolve_resume(str(tmp_path / "elsewhere"))


def test_resume_auto_never_picks_an_unmarked_folder(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=0)
    _save(m, 2)
    # newer folders that look like checkpoints but lack the COMPLETE marker, one of them named by
    # `latest` (commit never leaves such a folder: it writes COMPLETE before the rename; a partial
    # copy of a run folder can)
    for step in (4, 6):
        d = tmp_path / f"step_{step:06d}"
        (d / "model_optim").mkdir(parents=True)
        (d / "trainer_state.json").write_text('{"step": %d}' % step)
    (tmp_path / "latest").write_text("step_000006\n")
    # a temporary folder is never a candidate, even with everything in it
    tmp = m.begin(8)
    (tmp / "trainer_state.json").write_text('{"step": 8}')
    (tmp / "COMPLETE").write_text("ok\n")
    assert m.resolve_resume("auto") == tmp_path / "step_000002"
    assert [p.name for p in m.complete_checkpoints()] == ["step_000002"]
    (tmp_path / "step_000006" / "COMPLETE").write_text("ok\n")  # the marker is what makes it a checkpoint
    assert m.resolve_resume("auto") == tmp_path / "step_000006"


def test_a_run_does_not_start_beside_newer_checkpoints(tmp_path):
    """A fresh run, or a rewind to an earlier step, in a root that holds later checkpoints: keep-last-k
    would delete each new save in their favour and resume=auto would continue the old ones. Refused
    at start; the checkpoint just committed is never pruned in any case."""
    old = CheckpointManager(tmp_path, keep_last=2)
    for s in (20, 30):
        _save(old, s)
    m = CheckpointManager(tmp_path, keep_last=2)
    with pytest.raises(CheckpointError, match=r"holds step_000020, step_000030, newer than this run's start \(a fresh "
                                              r"start\)"):
        m.check_start(0)
    with pytest.raises(CheckpointError, match=r"holds step_000030, newer than this run's start \(step 20\)"):
        m.check_start(20)
    m.check_start(30)  # resuming the newest: nothing later
    assert _save(m, 5).exists()  # (were a run to save anyway, its own save survives the pruning)


def test_owns_tells_this_roots_checkpoints_from_another_runs(tmp_path):
    """A resume of another run's checkpoint must not look for that run's HF export in this run's folder."""
    m = CheckpointManager(tmp_path / "a")
    mine = _save(m, 2)
    theirs = _save(CheckpointManager(tmp_path / "b"), 2)
    assert m.owns(mine) and not m.owns(theirs)
