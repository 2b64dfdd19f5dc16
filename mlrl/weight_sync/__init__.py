"""Weight synchronisation trainer -> vLLM engines behind one call: `await weight_sync.sync(version)`.

- `make_weight_sync(cfg.weight_sync, pool, source)` picks the transport (broadcast over
  torch.distributed, safetensors on disk, CUDA IPC); the loop never branches on it.
- `WeightSource` is the trainer as seen from the driver; `HFWeightSource` implements it for an
  in-process Hugging Face model; trainer ranks take part through `sender.push_from_rank`.
- Every sync is verified (checksums of what each engine received, canary logprobs) and retried
  once; a second failure raises `WeightSyncError`.

This package imports no vllm (the receiver inside vLLM lives in mlrl.rollout.worker_ext and uses
the torch-only mlrl.weight_sync.wire / .receiver).
"""

from mlrl.weight_sync.sender import PushRequest, SendReport, bucketize, push_from_rank
from mlrl.weight_sync.source import HFWeightSource, WeightSource
from mlrl.weight_sync.sync import SyncReport, WeightSync, WeightSyncError, make_weight_sync

__all__ = ["HFWeightSource", "PushRequest", "SendReport", "SyncReport", "WeightSource", "WeightSync", "WeightSyncError",
           "bucketize", "make_weight_sync", "push_from_rank"]
