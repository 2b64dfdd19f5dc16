"""mlrl.checkpoint.Checkpointer with checkpoint.async_save: a save whose shards are still being written in
the background is not COMPLETE and never resumed from; it is committed only after the trainer
has finalized it, and always before the next save. The trainer is a test double of the Policy's
checkpoint calls that behaves like megatron-core's async queue: a save returns at once, and only
a finalize call after the background write has ended writes the shard folder's metadata."""

from pathlib import Path

from mlrl.checkpoint import Checkpointer, CheckpointManager, read_state
from mlrl.ckpt_files.layout import is_complete

META = "mlrl_checkpoint.json"  # written by the trainer's finalize step (mlrl.trainer.rank.dist_ckpt)


class AsyncTrainer:
    """save_checkpoint / finalize_checkpoints of the Policy (TrainerClient), with megatron-core's async semantics."""

    def __init__(self, background: bool = True):
        self.background = background   # False: the trainer saved synchronously (nothing left to finalize)
        self.written = False           # the background writes of every pending save have ended
        self.unfinalized: list[Path] = []
        self.calls: list[tuple] = []

    def save_checkpoint(self, path: Path, critic_path: Path | None = None) -> None:
        self.calls.append(("save", path.parent.name.split("-")[1]))
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_text("shard")
        if self.background:
            self.unfinalized.append(path)
            self.written = False
        else:
            (path / META).write_text("{}")

    def finalize_checkpoints(self, blocking: bool = True) -> int:
        self.calls.append(("finalize", blocking))
        if blocking or self.written:   # blocking waits for the writes to end
            for p in self.unfinalized:
                (p / META).write_text("{}")
            self.unfinalized.clear()
        return len(self.unfinalized)


def _state(version=0):
    return {"weight_version": version, "sampler": {"epoch": 0, "pos": version}}


def test_unfinalized_async_save_is_not_complete_and_not_resumed_from(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", keep_last=5)
    trainer = AsyncTrainer()
    ckpt = Checkpointer(manager, tmp_path, trainer, async_save=True)
    assert ckpt.save(2, _state(2)) is None                                # returned while the shards are being written
    (tmp,) = (tmp_path / "ck").glob(".tmp-step_000002-*")
    assert not is_complete(tmp) and not (tmp / "model_optim" / META).exists()
    assert not (tmp_path / "ck" / "step_000002").exists() and not (tmp_path / "ck" / "latest").exists()
    assert manager.resolve_resume("auto") is None and ckpt.last_saved is None
    # a poll while the writes go on commits nothing
    assert ckpt.finalize(blocking=False) is None
    assert manager.resolve_resume("auto") is None and ckpt.pending is not None
    # the writes end: the next poll finalizes on the trainer, then commits
    trainer.written = True
    done = ckpt.finalize(blocking=False)
    assert done == tmp_path / "ck" / "step_000002" == manager.resolve_resume("auto") == ckpt.last_saved
    assert (done / "model_optim" / META).is_file() and is_complete(done)  # COMPLETE only after the finalize step
    assert read_state(done)["step"] == 2 and read_state(done)["weight_version"] == 2
    assert not list((tmp_path / "ck").glob(".tmp-*")) and ckpt.pending is None
    assert ckpt.finalize() is None and trainer.calls[-1] == ("finalize", False)  # nothing pending: no trainer call


def test_next_save_and_exit_commit_the_pending_save_first(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", keep_last=5)
    trainer = AsyncTrainer()
    ckpt = Checkpointer(manager, tmp_path, trainer, async_save=True)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))        # blocks on step 1's finalization before writing step 2
    assert trainer.calls == [("save", "step_000001"), ("finalize", False),
                             ("finalize", True), ("save", "step_000002"), ("finalize", False)]
    assert [p.name for p in manager.complete_checkpoints()] == ["step_000001"]
    assert manager.resolve_resume("auto").name == "step_000001"          # step 2 is still being written
    assert ckpt.finalize() == tmp_path / "ck" / "step_000002"  # at exit: blocking
    assert manager.resolve_resume("auto").name == "step_000002"
    assert read_state(manager.latest())["weight_version"] == 2


def test_save_already_finished_or_synchronous_commits_at_once(tmp_path):
    # async_save requested, but nothing is left to finalize when the trainer returns: committed now
    manager = CheckpointManager(tmp_path / "a")
    trainer = AsyncTrainer(background=False)
    assert Checkpointer(manager, tmp_path, trainer, async_save=True).save(3, _state()) == tmp_path / "a" / "step_000003"
    assert trainer.calls == [("save", "step_000003"), ("finalize", False)]
    # async_save off: the synchronous path, no finalize call at all
    manager = CheckpointManager(tmp_path / "s")
    trainer = AsyncTrainer(background=False)
    assert (
        Checkpointer(manager, tmp_path, trainer, async_save=False).save(4, _state()) == tmp_path / "s" / "step_000004"
    )
    assert trainer.calls == [("save", "step_000004")] and manager.resolve_resume("auto").name == "step_000004"
