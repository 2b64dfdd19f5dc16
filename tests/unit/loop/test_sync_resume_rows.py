"""A synchronous run resuming an asynchronous run's checkpoint: the prompts that were in flight at
the save come first (the sampler position was saved after them), so none is skipped."""

from mlrl.data.sampler import PromptSampler
from mlrl.loop import LoopState, RunContext, next_rows


def test_in_flight_rows_of_the_checkpoint_come_before_the_sampler():
    sampler = PromptSampler([{"row": i} for i in range(10, 20)], seed=0, shuffle=False)
    ctx = RunContext(cfg=None, policy=None, engines=None, weight_sync=None, runner=None, sampler=sampler,
                     logger=None, checkpoint=None, saves=None,
                     state=LoopState(resume_rows=[{"row": 1}, {"row": 2}, {"row": 3}]))
    assert [r["row"] for r in next_rows(ctx, 2)] == [1, 2]
    assert [r["row"] for r in next_rows(ctx, 3)] == [3, 10, 11]
    assert [r["row"] for r in next_rows(ctx, 2)] == [12, 13] and ctx.state.resume_rows == []


def test_in_flight_rows_with_values_json_cannot_store_survive_the_checkpoint(tmp_path):
    """Parquet timestamp / binary columns (datetime, bytes) in a row in flight made the async save's
    commit fail (json.dump) after the trainer's shards were written: rows are recorded by position."""
    import datetime

    import pytest

    from mlrl.checkpoint.manager import CheckpointManager, read_state
    from mlrl.config import load_config
    from mlrl.loop import saved_loop_state

    rows = [{"row": i, "when": datetime.datetime(2026, 1, i + 1), "blob": bytes([i])} for i in range(6)]
    sampler = PromptSampler(rows, seed=0, shuffle=False)
    taken = sampler.next_batch(4)
    outsider = {"row": 99}  # not the dataset's own object: recorded as it is
    ctx = RunContext(cfg=load_config(None, []), policy=None, engines=None, weight_sync=None, runner=None,
                     sampler=sampler, logger=None, checkpoint=None, saves=None,
                     state=LoopState(in_flight={0: taken[2], 1: taken[3]}, resume_rows=[outsider]))
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(3)
    done = manager.commit(tmp, 3, {"step": 3, **saved_loop_state(ctx)})
    saved = read_state(done)
    resumed = PromptSampler.from_state(rows, saved["sampler"], seed=0, shuffle=False)
    back = resumed.restore(saved["in_flight_rows"])
    assert back[0] is rows[2] and back[1] is rows[3] and back[2] == outsider
    with pytest.raises(ValueError, match="data.train changed since the save"):
        PromptSampler(rows[:2], seed=0).restore(saved["in_flight_rows"])
