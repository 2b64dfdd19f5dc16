"""Asynchronous DAPO dynamic sampling: each dropped (uninformative) group lets the producer start one
more prompt, but a step that stops at max_rounds * prompts_per_step takes fewer extra groups than
it was granted. The unused credits are taken back: in flight stays within the staleness bound, where
it grew by prompts_per_step - kept every such step (the extra groups then aged into stale ones)."""

import asyncio

from mlrl.config import load_config
from mlrl.data.sampler import PromptSampler
from mlrl.loop import LoopState, RunContext
from mlrl.loop_async import AsyncState, collect, produce, wake_producer
from mlrl.types import EpisodeStatus, Sample
from mlrl.workflow.runner import EpisodeResult, GroupResult

P, ETA = 2, 0


class FlatRunner:
    """Every group scores all 1.0: dynamic sampling drops each one."""

    metric_prefix = ""

    def __init__(self, engine):
        self.engine = engine

    async def run_group(self, row, n):
        await asyncio.sleep(0.001)
        v = self.engine.version
        samples = [Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3, versions=[-1, v, v],
                          reward=1.0, prompt_len=1, group_id=str(row["row"])) for _ in range(n)]
        return GroupResult(str(row["row"]), row, [EpisodeResult(EpisodeStatus.COMPLETED, [s]) for s in samples])


class Engine:
    version = 0


async def test_unused_refill_credits_are_taken_back():
    cfg = load_config(None, [f"trainer.prompts_per_step={P}", "trainer.samples_per_prompt=2",
                             f"rollout.staleness={ETA}", "algorithm.rollout_is=tis",
                             "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2",
                             "workflow.max_failure_fraction=0.9"])
    engine = Engine()
    ctx = RunContext(cfg=cfg, policy=None, engines=engine, weight_sync=None, runner=FlatRunner(engine),
                     sampler=PromptSampler([{"row": i} for i in range(1000)], seed=0), logger=None, checkpoint=None,
                     saves=None, state=LoopState())
    st, q = AsyncState(), asyncio.PriorityQueue()
    prod = asyncio.create_task(produce(ctx, st, q, ETA))
    try:
        for step in range(1, 5):
            samples, metrics, stale = await collect(ctx, st, q, ETA, step)
            assert samples == [] and stale == 0 and metrics["samples/total"] == 2 * P * 2  # max_rounds * P groups
            await asyncio.sleep(0.05)  # the producer starts whatever the bound allows
            assert len(ctx.state.in_flight) <= (ETA + 1) * P, (step, len(ctx.state.in_flight))
            ctx.state.version = engine.version = step
            await wake_producer(st)
    finally:
        prod.cancel()
        await asyncio.gather(prod, return_exceptions=True)
