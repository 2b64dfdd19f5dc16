"""The receiving end of mlrl's weight sync, inside vLLM's worker processes.

Two pieces, both loaded by every mlrl engine (see mlrl.rollout.server):
- `MlrlWeightTransferEngine`, registered in vLLM's weight-transfer framework as backend "mlrl"
  (`--weight-transfer-config {"backend":"mlrl"}`). The framework fits the lifecycle exactly:
  `/init_weight_transfer_engine` (join the group), `/start_weight_update`,
  `/update_weights` (receive + load), `/finish_weight_update` (finalize + set the engine's
  weight version, which then labels every generated token). What it lacks on CPU is a
  transport — its built-in engines are NCCL / CUDA-IPC / RDT only, and its IPC engine requires
  pickled handles over HTTP (VLLM_ALLOW_INSECURE_SERIALIZATION) — so the transport is mlrl's own
  torch-only code (mlrl.weight_sync.wire / .receiver): gloo on CPU, NCCL on GPU, safetensors
  on disk, and JSON-encoded CUDA IPC handles.
- `MlrlWorkerExtension` (`--worker-extension-cls`): small `collective_rpc` methods the
  framework has no endpoint for: the last update's report (checksums), and one hook for
  tools/bench_weight_sync.py's reference measurements (mlrl.weight_sync.bench_reference,
  imported only when the benchmark calls it).

Applying the weights (the CPU reload problem, ../shared/DESIGN.md): `start_weight_update` opens
vLLM's layer-wise reload (`initialize_layerwise_reload`), every received bucket goes through
`model.load_weights`, and `finish_weight_update` runs `finalize_layerwise_reload` — the same
path as `Worker.reload_weights(is_checkpoint_format=True)`. With tied embeddings the LM head
receives no tensor and keeps the oneDNN handler packed from the OLD embedding (a documented
limitation of vllm/model_executor/model_loader/reload), so afterwards every module whose
quant method is `UnquantizedEmbeddingMethod` re-runs `process_weights_after_loading`, which
re-packs the handler from the new weights. The engine then equals a freshly started one on the
new weights (tests/integration/rollout checks it to 1e-4; measured 0.0). The driver resets the
prefix cache after every update and only updates paused engines.

Invariant: an update either completes (report with per-sender digests, no missing parameter) or
raises; a failed update leaves the worker ready for a fresh `start_weight_update`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from mlrl.weight_sync.receiver import Receiver

BACKEND = "mlrl"


@dataclass
class MlrlInitInfo(WeightTransferInitInfo):
    group: dict[str, Any] = field(default_factory=dict)  # mlrl.weight_sync.wire.GroupSpec JSON
    receiver_offset: int = 0                             # index of this engine's first worker among all receivers


@dataclass
class MlrlUpdateInfo(WeightTransferUpdateInfo):
    transport: str = "broadcast"     # a name in mlrl.weight_sync.registry.TRANSPORTS; the other fields are its own
    version: int | None = None
    verify: bool = True
    session: str | None = None       # broadcast: the joined session
    disk_dir: str | None = None      # disk
    num_senders: int = 1             # disk
    senders: list | None = None      # cuda_ipc: per sender, buckets of JSON handles


def refresh_embedding_kernels(model: torch.nn.Module) -> list[str]:
    """Re-run process_weights_after_loading of every unquantized embedding / LM head (tied LM-head fix)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    names = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, UnquantizedEmbeddingMethod):
            qm.process_weights_after_loading(m)
            names.append(name)
    return names


class MlrlWeightTransferEngine(WeightTransferEngine[MlrlInitInfo, MlrlUpdateInfo]):
    init_info_cls = MlrlInitInfo
    update_info_cls = MlrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = Receiver(device)
        self.last_report: dict[str, Any] = {}
        self._update: dict[str, Any] | None = None

    def _worker_index(self) -> int:
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: MlrlInitInfo) -> None:
        self.receiver.join(init_info.group, init_info.receiver_offset + self._worker_index())

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        expected = {n for n, _ in self.model.named_parameters()}
        initialize_layerwise_reload(self.model)
        self._update = {"t0": time.perf_counter(), "expected": expected, "loaded": set(), "streams": [], "recv_s": 0.0}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only machine
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MlrlUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self._update is None:
            raise RuntimeError("mlrl weight transfer: update_weights before start_weight_update")
        loaded = self._update["loaded"]

        def apply(bucket):
            with disable_mtp_completeness_check():
                names = self.model.load_weights(bucket)
            if names:
                loaded.update(names)

        try:
            rep = self.receiver.receive(asdict(update_info), apply)
        except BaseException:
            self._update = None  # (a failed broadcast stream also left the group: the driver re-joins)
            # close the layer-wise session so the retry's initialize starts clean (layers that were only
            # partly loaded would otherwise keep their buffered state); the weights are now a mix, which
            # the driver knows: it retries a full update or stops the run
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        self._update["streams"] += rep["streams"]
        self._update["recv_s"] += rep["seconds"]
        self._update["transport"], self._update["version"] = rep["transport"], rep["version"]

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        u, self._update = self._update, None
        if u is None:
            raise RuntimeError("mlrl weight transfer: finish_weight_update without start_weight_update")
        t1 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        refreshed = refresh_embedding_kernels(self.model)
        now = time.perf_counter()
        self.last_report = {
            "worker": self._worker_index(), "transport": u.get("transport"), "version": u.get("version"),
            "streams": u["streams"],
            "missing": sorted(u["expected"] - u["loaded"]), "refreshed": refreshed,
            "receive_s": u["recv_s"], "finalize_s": now - t1, "total_s": now - u["t0"],
        }

    def shutdown(self) -> None:
        self.receiver.close()


try:
    WeightTransferEngineFactory.register_engine(BACKEND, MlrlWeightTransferEngine)
except ValueError:  # already registered in this process
    pass


class MlrlWorkerExtension:
    """Mixed into vLLM's Worker (`--worker-extension-cls`); methods are called via POST /collective_rpc."""

    def _mlrl_engine(self) -> MlrlWeightTransferEngine:
        eng = getattr(self, "weight_transfer_engine", None)
        if not isinstance(eng, MlrlWeightTransferEngine):
            raise RuntimeError('this engine was not started with --weight-transfer-config {"backend":"mlrl"}')
        return eng

    def mlrl_weight_report(self) -> dict[str, Any]:
        """Report of the last finished update on this worker (JSON)."""
        return dict(self._mlrl_engine().last_report)

    def mlrl_bench_reference(self, call_json: str) -> dict[str, Any]:
        """Benchmark only (tools/bench_weight_sync.py): this worker's side of a reference measurement
        on its joined group, see mlrl.weight_sync.bench_reference.on_worker."""
        from mlrl.weight_sync import bench_reference

        return bench_reference.on_worker(self._mlrl_engine().receiver, json.loads(call_json))
