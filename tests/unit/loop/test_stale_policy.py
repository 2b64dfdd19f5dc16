"""rollout.stale_policy: a group whose samples are older than rollout.staleness versions (it stayed
in flight across weight syncs) is dropped with `drop` (counted in async/stale_dropped) and kept for
training with `reweight`, where the importance-sampling correction (algorithm.rollout_is, required
for staleness > 0) weighs it by the train/rollout probability ratio."""

import asyncio

import pytest

from mlrl.config import load_config
from mlrl.loop import LoopState, RunContext
from mlrl.loop_async import AsyncState, collect
from mlrl.types import Sample
from mlrl.workflow.api import EpisodeStatus
from mlrl.workflow.runner import EpisodeResult, GroupResult

ETA = 1


def _group(gid: str, version: int, reward: float) -> GroupResult:
    def sample(r):
        return Sample(tokens=[1, 5, 6, 7], loss_mask=[0, 0, 1, 1], rollout_logprobs=[0, 0, -1.0, -1.2],
                      versions=[-1, -1, version, version], reward=r, prompt_len=2, group_id=gid)
    return GroupResult(gid, {}, [EpisodeResult(EpisodeStatus.COMPLETED, [sample(reward)]),
                                 EpisodeResult(EpisodeStatus.COMPLETED, [sample(1.0 - reward)])])


async def _collect_one_step(policy: str):
    cfg = load_config(None, ["trainer.prompts_per_step=2", "trainer.samples_per_prompt=2", f"rollout.staleness={ETA}",
                             f"rollout.stale_policy={policy}", "algorithm.rollout_is=tis", "workflow.reward_workers=0"])
    ctx = RunContext(cfg=cfg, policy=None, engines=None, weight_sync=None, runner=None, sampler=None, logger=None,
                     checkpoint=None, saves=None, state=LoopState(version=3))
    q: asyncio.PriorityQueue = asyncio.PriorityQueue()
    for key, (gid, version) in enumerate([("old", 1), ("fresh", 3)]):  # version 1 is 2 > eta versions behind
        ctx.state.in_flight[key] = {"row": key}
        q.put_nowait((key, _group(gid, version, reward=1.0)))
    return await collect(ctx, AsyncState(), q, ETA, step=4)


@pytest.mark.parametrize("policy,kept,dropped", [("drop", {"fresh"}, 2), ("reweight", {"old", "fresh"}, 0)])
async def test_stale_policy_drops_or_keeps_the_old_group(policy, kept, dropped):
    samples, metrics, stale = await _collect_one_step(policy)
    assert {s.group_id for s in samples} == kept
    assert stale == dropped
