"""Weight synchronisation trainer -> vLLM engines behind one call: `await weight_sync.sync(version)`.

- `make_weight_sync(cfg.weight_sync, pool, source, model_dir=..., ...)` builds the transport
  named by `weight_sync.transport` (broadcast over torch.distributed, safetensors on disk, CUDA
  IPC); the loop never branches on it. Names are resolved in one place, mlrl.weight_sync.registry.
- `WeightSource` is the trainer as seen from the driver; trainer ranks take part through
  `sender.push_from_rank`.
- Every sync is verified (checksums of what each engine received, canary logprobs) and retried
  once; a second failure raises `WeightSyncError`.
- An engine restarted after a crash is brought to the pool's version by `weight_sync.refresh`,
  which the caller installs as the pool's refresher.

Modules, in dependency order (no cycles): wire (broadcast wire protocol, torch only) -> source
(PushRequest, SendReport, WeightSource) -> sync (WeightSync base: pause / verify / canary /
retry) -> transports (each transport's driver, send and receive parts) -> registry (name ->
parts, make_weight_sync) -> sender (trainer ranks), receiver (engine workers). What only tests
and benchmarks use lives outside the package: tools/hf_weight_source.py (a one-process source over
an HF model) and tools/weight_sync_reference.py (tools/bench_weight_sync.py's raw-broadcast reference).

This package imports no vllm and no other mlrl package than mlrl.config and mlrl.interfaces (the
receiver inside vLLM is the rollout package's worker extension, rollout/worker_ext.py, which uses
the torch-only .receiver; the dependency goes that way only).
"""

from mlrl.weight_sync.registry import TRANSPORTS, UnknownTransportError, make_weight_sync
from mlrl.weight_sync.sender import bucketize, push_from_rank
from mlrl.weight_sync.source import PushRequest, SendReport, WeightSource
from mlrl.weight_sync.sync import SyncReport, SyncSetup, WeightSync, WeightSyncError

__all__ = ["PushRequest", "SendReport", "SyncReport", "SyncSetup", "TRANSPORTS", "UnknownTransportError",
           "WeightSource", "WeightSync", "WeightSyncError", "bucketize", "make_weight_sync", "push_from_rank"]
