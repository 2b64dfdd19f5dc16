"""The built-in RLVR workflow with a slow tail: the groups of prompts whose answer is "3" return
SLOW_S seconds after their samples were generated (as a slow reward, tool or judge would make
them). Their tokens keep the weight version they were sampled with while the async run syncs
new weights, so they arrive more than `rollout.staleness` versions behind: what
`rollout.stale_policy` is for. tests/integration/loop/test_stale_policy_run.py runs it."""

import asyncio

from mlrl.workflow.builtin.rlvr import RLVRWorkflow

SLOW_S = 5.0


class SlowTailRLVR(RLVRWorkflow):
    async def arun_group(self, engine, data, n):
        out = await super().arun_group(engine, data, n)
        if str(data.get("answer")) == "3":
            await asyncio.sleep(SLOW_S)
        return out
