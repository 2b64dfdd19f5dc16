"""The worker extension of tools/bench_weight_sync.py's engines: mlrl's own
(mlrl.rollout.worker_ext.MlrlWorkerExtension) plus the hook of the benchmark's reference
measurements. vLLM imports it inside the engine as `weight_sync_reference_ext.ReferenceWorkerExtension`
(`--worker-extension-cls`; tools/ is on that engine's PYTHONPATH, see weight_sync_reference.engine_server).
"""

from __future__ import annotations

import json
from typing import Any

from weight_sync_reference import on_worker

from mlrl.rollout.worker_ext import MlrlWorkerExtension


class ReferenceWorkerExtension(MlrlWorkerExtension):
    def mlrl_bench_reference(self, call_json: str) -> dict[str, Any]:  # weight_sync_reference.WORKER_HOOK
        """This worker's side of a reference measurement on its joined group (weight_sync_reference.on_worker)."""
        return on_worker(self._mlrl_engine().receiver, json.loads(call_json))
