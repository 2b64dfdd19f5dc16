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
