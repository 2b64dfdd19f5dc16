"""mlrl.checkpoint.Checkpointer with checkpoint.async_save: a save whose shards are still being written in
the background is not COMPLETE and never resumed from; it is committed only after the trainer
has finalized it, and always before the next save. The trainer is a test double of the Policy's
checkpoint calls that behaves like megatron-core's async queue: a save returns at once, and only
a finalize call after the background write has ended writes the shard folder's metadata."""

import shutil
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


class _Flaky(AsyncTrainer):
    """Its background writes end `after` polls after each save; `fail`: every finalize raises."""

    def __init__(self, after=1, fail=False):
        super().__init__()
        self.after, self.fail, self.polls = after, fail, 0

    def save_checkpoint(self, path, critic_path=None):
        self.polls = 0
        super().save_checkpoint(path, critic_path)

    def finalize_checkpoints(self, blocking=True):
        if self.fail:
            raise RuntimeError("rank 1 is gone")
        self.polls += 1
        self.written = self.polls > self.after
        return super().finalize_checkpoints(blocking=False)


def test_teardown_commits_a_save_whose_shards_get_written_in_time(tmp_path):
    """SIGTERM or a failed step with an async save in flight: it was dropped (committed only at the
    next step's poll); finish_pending commits it if its shards are written within the bound."""
    manager = CheckpointManager(tmp_path / "ck", keep_last=5)
    ckpt = Checkpointer(manager, tmp_path, _Flaky(after=3), async_save=True)
    assert ckpt.save(2, _state(2)) is None
    assert ckpt.finish_pending(timeout_s=5, poll_s=0.01) == tmp_path / "ck" / "step_000002"
    assert manager.resolve_resume("auto").name == "step_000002"
    # writes that do not end in time: nothing committed, never resumed from; no exception either
    slow = Checkpointer(CheckpointManager(tmp_path / "slow"), tmp_path, _Flaky(after=10**6), async_save=True)
    slow.save(2, _state(2))
    assert slow.finish_pending(timeout_s=0.05, poll_s=0.01) is None and slow.pending is not None
    assert CheckpointManager(tmp_path / "slow").resolve_resume("auto") is None
    broken = Checkpointer(CheckpointManager(tmp_path / "broken"), tmp_path, _Flaky(), async_save=True)
    broken.save(2, _state(2))
    broken.policy.fail = True
    assert broken.finish_pending(timeout_s=0.05, poll_s=0.01) is None


class _Job:
    """An OfflineJob stand-in: SIGTERM arrives during step `fail_at`."""

    kind, title, batch_size = "sft", "SFT", 1

    def __init__(self, fail_at=None):
        self.train = [{"i": i} for i in range(8)]
        self.fail_at, self.steps = fail_at, 0

    def step(self, policy, batch):
        self.steps += 1
        if self.steps == self.fail_at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, in the step
        return {"sft/loss": 1.0}

    def evaluate(self, policy):
        return None


def _offline(tmp_path, monkeypatch, trainer, job, *overrides):
    """run_offline on stand-ins (no ranks); `overrides` after the defaults (async saves every 2 of 4 steps)."""
    from types import SimpleNamespace

    from mlrl.config import load_config
    from mlrl.jobs import offline

    monkeypatch.setattr(offline, "TrainerGroup", lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(offline, "TrainerClient", lambda group: trainer)
    monkeypatch.setattr(offline, "rank_env", lambda *a, **k: {})
    monkeypatch.setattr(offline, "Placement", lambda: SimpleNamespace(host="127.0.0.1", trainer_env={},
                                                                      spawn_trainer=None, close=lambda: None))
    monkeypatch.setattr(offline, "resolve_model_dir", lambda spec: tmp_path)
    monkeypatch.setattr(offline, "check_model_weights", lambda hf_dir: None)  # (a folder without the model)
    monkeypatch.setattr(offline, "check_model_init_from", lambda *a, **k: None)
    cfg = load_config(None, [f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=4", "checkpoint.save_every=2",
                             "checkpoint.async_save=true", "checkpoint.hf_export_at_end=false",
                             "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false",
                             *overrides])
    return offline.run_offline(cfg, SimpleNamespace(trainer_devices=None), lambda hf: job)


def test_sft_and_dpo_runs_commit_async_saves_only_once_written(tmp_path, monkeypatch):
    """The offline jobs built their Checkpointer without async_save: with checkpoint.async_save (GPU)
    each save was committed (COMPLETE, `latest`) while megatron-core still wrote its shards."""
    assert _offline(tmp_path, monkeypatch, _Flaky(after=0), _Job()) == 0
    done = CheckpointManager(tmp_path / "run" / "checkpoints").complete_checkpoints()
    assert [p.name for p in done] == ["step_000002", "step_000004"]
    assert all((p / "model_optim" / META).is_file() for p in done)  # finalized before they were committed


def test_a_sigtermed_sft_run_exits_143_and_keeps_the_async_save_already_written(tmp_path, monkeypatch):
    """SIGTERM (a Slurm time limit) killed an SFT / DPO run at once: no teardown, and the save whose
    shards were written was lost (it is committed only at the next step's poll)."""
    import signal

    before = signal.getsignal(signal.SIGTERM)  # (an earlier test in the process may have installed one)
    assert _offline(tmp_path, monkeypatch, _Flaky(after=0), _Job(fail_at=3)) == 143
    assert CheckpointManager(tmp_path / "run" / "checkpoints").resolve_resume("auto").name == "step_000002"
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone with it


def test_an_export_the_last_run_did_not_finish_is_written_on_resume(tmp_path, monkeypatch):
    """Preempted during the final HF export: the step's checkpoint was committed first, so the resumed
    run had 0 steps left, printed "finished" and never wrote the export."""
    from types import SimpleNamespace

    from mlrl.config import load_config

    exported = []
    trainer = SimpleNamespace(export_hf=lambda out: exported.append(out))
    ckpt = Checkpointer(CheckpointManager(tmp_path / "ck"), tmp_path, trainer)
    c = load_config(None, ["checkpoint.hf_export_every=0"]).checkpoint  # hf_export_at_end: on by default
    assert ckpt.export_left_undone(c, 10, 10) and not ckpt.export_left_undone(c, 5, 10)
    ckpt.export_hf(10)
    assert exported == [tmp_path / "hf" / "step_000010"]
    exported[0].mkdir(parents=True)
    assert ckpt.export_left_undone(c, 10, 10)  # a folder without its config.json: the rename had not happened
    (exported[0] / "config.json").write_text("{}")
    assert not ckpt.export_left_undone(c, 10, 10)  # there: nothing to redo
    assert not ckpt.export_left_undone(c, 0, 10)


def test_a_lora_export_without_its_adapter_is_not_complete(tmp_path):
    """A LoRA run's adapter folder is written after the merged model, into it (export_merged) or into
    a step folder that exists from the adapter's own temporary on: the folder alone was taken as done,
    and a run preempted in its final export finished without the adapter."""
    from types import SimpleNamespace

    from mlrl.config import load_config

    ckpt = Checkpointer(CheckpointManager(tmp_path / "ck"), tmp_path, SimpleNamespace())
    out = ckpt.export_path(10)
    for merged in (True, False):
        c = load_config(None, ["checkpoint.hf_export_every=0", f"checkpoint.export_merged={str(merged).lower()}"])
        shutil.rmtree(out, ignore_errors=True)
        (out / "adapter.tmp").mkdir(parents=True)  # the adapter's writer had started
        if merged:
            (out / "config.json").write_text("{}")
        assert ckpt.export_left_undone(c.checkpoint, 10, 10, lora=True)
        (out / "adapter").mkdir()
        (out / "adapter" / "adapter_config.json").write_text("{}")
        assert not ckpt.export_left_undone(c.checkpoint, 10, 10, lora=True)
        assert ckpt.export_left_undone(c.checkpoint, 10, 10, lora=False) != merged  # a full export needs the model


def test_the_offline_job_writes_the_missing_final_export_on_resume(tmp_path, monkeypatch, caplog):
    trainer = _Flaky(after=0)
    exported = []
    trainer.export_hf = lambda out: exported.append(out.name)
    trainer.load_checkpoint = lambda path, critic=None: {"optimizer_steps": 4, "optimizer_loaded": True,
                                                         "rng_restored": False, "saved_layout": {"tp": 1},
                                                         "scheduler_overrides": {}}
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    tmp = manager.begin(4)
    (tmp / "model_optim").mkdir()
    manager.commit(tmp, 4, {"kind": "sft", "step": 4, "sampler": {"epoch": 0, "index": 4, "consumed": 4}})
    # resume=auto finds step 4; hf_export_at_end makes its export due
    with caplog.at_level("WARNING"):
        assert _offline(tmp_path, monkeypatch, trainer, _Job(), "checkpoint.hf_export_at_end=true") == 0
    assert exported == ["step_000004"]
    assert "the random state was not restored" in caplog.text  # what the resume did not bring back is said


def test_a_stop_during_a_save_keeps_the_steps_metrics_line(tmp_path, monkeypatch):
    """SFT / DPO wrote the step's metrics line after its checkpoint and export: a SIGTERM during the
    step-4 export lost step 4's line for good (the checkpoint was committed, the resumed run started
    at step 5). The line is written first now, as the RL loop does."""
    import json
    import os
    import signal

    trainer = _Flaky(after=0)

    def export_then_killed(out):
        os.kill(os.getpid(), signal.SIGTERM)  # the job's handler raises here, inside the export

    trainer.export_hf = export_then_killed
    assert _offline(tmp_path, monkeypatch, trainer, _Job(), "checkpoint.hf_export_every=4",
                    "checkpoint.async_save=false") == 143
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert CheckpointManager(tmp_path / "run" / "checkpoints").resolve_resume("auto").name == "step_000004"
