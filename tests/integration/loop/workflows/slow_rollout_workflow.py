"""The built-in RLVR workflow, every group SLOW_S seconds late (a slow reward, tool or judge would
make it so), and saying when: a file named by the time, in the folder $MLRL_TEST_MARKERS, as soon
as its samples are generated. tests/integration/loop/test_terminate.py sends its SIGTERM inside a
step's rollout with it."""

import asyncio
import os
import time
from pathlib import Path

from mlrl.workflow.builtin.rlvr import RLVRWorkflow

SLOW_S = 3.0


class SlowRolloutRLVR(RLVRWorkflow):
    async def arun_group(self, engine, data, n):
        out = await super().arun_group(engine, data, n)
        markers = os.environ.get("MLRL_TEST_MARKERS")
        if markers:
            Path(markers, f"{time.time():.6f}").touch()
        await asyncio.sleep(SLOW_S)
        return out
