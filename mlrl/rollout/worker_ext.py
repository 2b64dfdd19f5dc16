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
  framework has no endpoint for: the last update's report (checksums), leaving the groups on
  vLLM 0.26 (which lacks /shutdown_weight_transfer_engine, see mlrl.rollout.vllm_compat), and the
  CPU capture of routed experts for MoE router replay (`mlrl_routing_enable` /
  `mlrl_routing_take`, see mlrl.rollout.routing). Benchmark-only hooks live in subclasses outside
  the package, named by `ServerSpec.worker_extension` (tools/weight_sync_reference_ext.py).

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
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from mlrl.rollout import vllm_compat
from mlrl.rollout.server import EAGER_RANKS_ENV
from mlrl.weight_sync.receiver import Receiver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

BACKEND = "mlrl"


def count_greater_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` (each chosen token's rank among the logprobs), eager."""
    return (x >= values).sum(-1)


def eager_token_ranks_on_cpu() -> bool:
    """On a CPU engine, rank the chosen tokens' logprobs eagerly instead of through vLLM's
    torch.compile'd helper (vllm/v1/sample/ops/logprobs.py). Compiled with inductor on 2 cores it
    cost every CPU engine ~1.9-2.4 s at its first request asking for logprobs (every mlrl request
    does; the first is the start-up canary: the CPU demo's first weight sync took 2.1 s, now 0.1 s)
    and, torch.compile's rule, ~1 s more to recompile with dynamic shapes at the first new batch
    shape (step 1's generate). `tools/bench_engine_start.py --compare ranks`. The math is the
    same: a comparison and a row sum, one temporary of the logits' shape. GPU engines keep vLLM's
    helper. True when replaced."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import sampler

    if not current_platform.is_cpu() or os.environ.get(EAGER_RANKS_ENV, "1") == "0":
        return False
    sampler.batched_count_greater_than = count_greater_equal  # pyright: ignore[reportPrivateImportUsage]
    return True


def rewind_seeded_generators_on_cpu() -> bool:
    """On a CPU engine, rewind a seeded request's random generator by restoring its state, where
    vLLM rewinds a Philox offset. A request whose prompt is split over engine steps (chunked
    prefill: more prompt tokens waiting than max_num_batched_tokens) is sampled at every partial
    step and the token discarded; vLLM 0.32 then rewinds its generator with
    `gen.set_offset(gen.get_offset() - 4)` (GPUModelRunner._bookkeeping_sync), which a CPU
    generator refuses ("RuntimeError: CPU Generator does not use offset"): the engine died at the
    first such step of a run with rollout.sampling.seed (every request then carries a seed), e.g.
    an evaluation of 64 SmolLM2 prompts x 8. Here the state of each generator the step will
    discard a sample of is saved when sampling begins (`sample_tokens`) and put back before the
    bookkeeping, whose own rewind then skips it: the request's draws are those of an unsplit
    prompt, as on GPU. True when installed (a CPU engine)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_mlrl_rewinds_generators", False):
        return True
    sample_tokens, bookkeeping = GPUModelRunner.sample_tokens, GPUModelRunner._bookkeeping_sync

    def discarded(runner: Any) -> dict[int, Any]:
        n = runner.input_batch.num_reqs
        gens = runner.input_batch.generators
        return {int(i): gens[int(i)] for i in runner.discard_request_mask.np[:n].nonzero()[0] if int(i) in gens}

    def saving_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._mlrl_saved_generators = {i: g.get_state() for i, g in discarded(self).items()}
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            self._mlrl_saved_generators = {}

    def restoring_bookkeeping(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = getattr(self, "_mlrl_saved_generators", {})
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in saved if i in gens}  # vLLM's offset rewind skips them
        for i, g in held.items():
            g.set_state(saved[i])
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(held)

    GPUModelRunner.sample_tokens = saving_sample_tokens  # pyright: ignore[reportAttributeAccessIssue]
    GPUModelRunner._bookkeeping_sync = restoring_bookkeeping  # pyright: ignore[reportAttributeAccessIssue]
    GPUModelRunner._mlrl_rewinds_generators = True  # pyright: ignore[reportAttributeAccessIssue]
    return True


eager_token_ranks_on_cpu()  # this module is imported in every engine worker (--worker-extension-cls)
rewind_seeded_generators_on_cpu()


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
            type(qm).process_weights_after_loading(qm, m)  # the class's, past any deferral left in place
            names.append(name)
    return names


def _no_processing(layer: torch.nn.Module) -> None:
    return None


def defer_embedding_kernels(model: torch.nn.Module) -> list[Any]:
    """CPU: during an update, the embeddings' process_weights_after_loading does nothing, because
    `refresh_embedding_kernels` runs it once the update is complete anyway. On CPU it packs the
    (tied) LM head for oneDNN; vLLM's layer-wise reload would pack it once more as soon as the
    embedding's weight arrived: SmolLM2-135M's 49152 x 576 head, ~0.3 s of a 0.9 s transfer
    (py-spy). Returns the quant methods to hand to `restore_embedding_kernels`."""
    if torch.cuda.is_available():
        return []  # on GPU the method is a no-op already
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    deferred = []
    for _, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, UnquantizedEmbeddingMethod) and "process_weights_after_loading" not in vars(qm):
            qm.process_weights_after_loading = _no_processing  # instance attribute over the class method
            deferred.append(qm)
    return deferred


def restore_embedding_kernels(deferred: list[Any]) -> None:
    for qm in deferred:
        vars(qm).pop("process_weights_after_loading", None)


def refresh_moe_kernels(model: torch.nn.Module) -> list[str]:
    """CPU: re-prepack every MoE layer's expert weights after a weight sync.

    vLLM's CPU experts (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) repack w13 / w2
    into their grouped-GEMM layout in `process_weights_after_loading`, which the unquantized MoE
    method runs on the first load only (`if not is_weight_update`,
    unquantized_fused_moe_method.py): after a reload the layer holds the new weights in the plain
    layout while the kernel reads them as packed (measured: canary gap 0.08 on a tiny Qwen3-MoE
    for an update with unchanged weights). Running the experts' own step again packs the new
    weights; afterwards the engine equals a fresh one (tests/integration/rollout)."""
    names = []
    for name, m in model.named_modules():
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU"):
            experts.process_weights_after_loading(m)
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
        if self._update is not None:  # an attempt that never finished (the sync failed on another engine):
            restore_embedding_kernels(self._update["deferred"])  # its deferral ends here, or would never end
        with vllm_compat.weight_update_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        self._update = {"t0": time.perf_counter(), "expected": expected, "loaded": set(), "streams": [], "recv_s": 0.0,
                        "deferred": defer_embedding_kernels(self.model)}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only machine
        with vllm_compat.weight_update_config(self.vllm_config):
            self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MlrlUpdateInfo) -> None:
        if self._update is None:
            raise RuntimeError("mlrl weight transfer: update_weights before start_weight_update")
        loaded = self._update["loaded"]

        def apply(bucket):
            with vllm_compat.mtp_completeness_check_disabled():
                # every vLLM model defines load_weights; WeightTransferEngine types the model as nn.Module
                names = self.model.load_weights(bucket)  # pyright: ignore[reportCallIssue]
            if names:
                loaded.update(names)

        try:
            rep = self.receiver.receive(asdict(update_info), apply)
        except BaseException:
            restore_embedding_kernels(self._update["deferred"])
            self._update = None  # (a failed broadcast stream also left the group: the driver re-joins)
            # close the layer-wise session so the retry's initialize starts clean (layers that were only
            # partly loaded would otherwise keep their buffered state); the weights are now a mix, which
            # the driver knows: it retries a full update or stops the run
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception:  # the original error is the one to report
                pass
            raise
        self._update["streams"] += rep["streams"]
        self._update["recv_s"] += rep["seconds"]
        self._update["transport"], self._update["version"] = rep["transport"], rep["version"]

    def finish_weight_update(self) -> None:
        with vllm_compat.weight_update_config(self.vllm_config):
            self._finish_weight_update()

    def _finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        u, self._update = self._update, None
        if u is None:
            raise RuntimeError("mlrl weight transfer: finish_weight_update without start_weight_update")
        t1 = time.perf_counter()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            restore_embedding_kernels(u["deferred"])
        refreshed = refresh_embedding_kernels(self.model)
        if not torch.cuda.is_available():
            refreshed += refresh_moe_kernels(self.model)
        if _ROUTING.get("store") is not None:
            _ROUTING["store"].reset_blocks()  # the prefix cache is reset after an update: so are its rows
            _ROUTING["layers"] = _bind_capturer(self.model, _ROUTING["capturer"])  # the reload rebuilt the routers
        now = time.perf_counter()
        self.last_report = {
            "worker": self._worker_index(), "transport": u.get("transport"), "version": u.get("version"),
            "streams": u["streams"],
            "missing": sorted(u["expected"] - u["loaded"]), "refreshed": refreshed,
            "receive_s": u["recv_s"], "finalize_s": now - t1, "total_s": now - u["t0"],
        }

    def shutdown(self) -> None:
        self.receiver.close()

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.26 declares this trainer-side hook abstract (0.32 dropped it from the worker-side
        engine): without it the engine cannot be instantiated on 0.26. mlrl's senders are its own
        (mlrl.weight_sync.sender)."""
        raise NotImplementedError("mlrl sends weights with mlrl.weight_sync.sender, not through vLLM")


try:
    WeightTransferEngineFactory.register_engine(BACKEND, MlrlWeightTransferEngine)
except ValueError:  # already registered in this process
    pass


_ROUTING: dict[str, Any] = {}  # this worker's routed-experts capture (one per process)


class MlrlWorkerExtension:
    """Mixed into vLLM's Worker (`--worker-extension-cls`); methods are called via POST /collective_rpc."""

    if TYPE_CHECKING:  # the Worker's attributes this mixin uses
        vllm_config: VllmConfig
        model_runner: GPUModelRunner

    def _mlrl_engine(self) -> MlrlWeightTransferEngine:
        eng = getattr(self, "weight_transfer_engine", None)
        if not isinstance(eng, MlrlWeightTransferEngine):
            raise RuntimeError('this engine was not started with --weight-transfer-config {"backend":"mlrl"}')
        return eng

    def mlrl_weight_report(self) -> dict[str, Any]:
        """Report of the last finished update on this worker (JSON)."""
        return dict(self._mlrl_engine().last_report)

    def mlrl_shutdown_weight_transfer(self) -> None:
        """Leave the joined groups (what vLLM >= 0.32's /shutdown_weight_transfer_engine does; 0.26 has
        no such route, see mlrl.rollout.vllm_compat)."""
        self._mlrl_engine().shutdown()

    # ------------------------------------------------------------------ routed experts (router replay)
    def mlrl_routing_enable(self, max_bytes: str = str(256 << 20)) -> dict[str, Any]:
        """Capture the experts every MoE router of this worker's model picks (idempotent).

        vLLM's own layer-level capture (`bind_routed_experts_capturer`: each router calls
        `capturer.capture(layer_id, topk_ids)` with logical expert ids) fills one step's buffer;
        a wrapper around `model_runner.execute_model` then hands the step's rows to the
        `RoutingStore`, split by request in the batch's order, at the positions the scheduler
        output gives (prefix-cache hits: see mlrl.rollout.routing)."""
        vllm_compat.release().require(vllm_compat.Feature.CPU_ROUTING_CAPTURE)  # (EnginePool checks it first)
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

        from mlrl.rollout.routing import RoutingStore

        runner = self.model_runner
        if _ROUTING.get("runner") is runner:
            return _ROUTING["info"]
        mc = self.vllm_config.model_config
        layers, experts, topk = mc.get_total_num_hidden_layers(), mc.get_num_experts(), mc.get_num_experts_per_tok()
        if experts <= 0:
            raise ValueError(f"router replay: the served model ({mc.hf_config.model_type}) has no MoE layers")
        max_tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        capturer = RoutedExpertsCapturer(max_tokens, self.vllm_config)
        store = RoutingStore(layers, topk, experts, self.vllm_config.cache_config.block_size, int(max_bytes))
        _ROUTING.update(capturer=capturer, layers=_bind_capturer(runner.model, capturer))
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            n = scheduler_output.total_num_scheduled_tokens
            capturer.device_buffer[:n].fill_(-1)  # rows no router wrote stay -1: detected, never replayed
            out = original(scheduler_output, *args, **kwargs)
            _record_step(runner, scheduler_output, capturer, store, _ROUTING["layers"])
            return out

        runner.execute_model = execute_model
        info = {"layers": layers, "experts": experts, "top_k": topk, "block_size": store.block_size,
                "dtype": str(store.dtype)}
        _ROUTING.update(runner=runner, store=store, info=info)
        return info

    def mlrl_routing_take(self, queries_json: str) -> dict[str, Any]:
        """Rows of each queried token sequence (JSON list of token-id lists) -> {"rows": [base64
        .npy or None per query], "stats": ...}."""
        from mlrl.rollout.routing import encode

        store = _ROUTING.get("store")
        if store is None:
            raise RuntimeError("mlrl_routing_take: routed-experts capture is not enabled on this worker")
        rows = [store.lookup(q) for q in json.loads(queries_json)]
        return {"rows": [None if r is None else encode(r) for r in rows], "stats": dict(store.stats),
                "bytes": store.nbytes()}


def _bind_capturer(model, capturer) -> list[int]:
    """vLLM's own binding of the capture callback to every MoE router; the MoE layer ids."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    bind_routed_experts_capturer(model, capturer)
    return sorted({int(m.layer_id) for m in model.modules() if hasattr(m, "layer_id") and (
        getattr(m, "capture_fn", None) is not None
        or getattr(getattr(m, "router", None), "capture_fn", None) is not None)})


def _record_step(runner, scheduler_output, capturer, store, moe_layers: list[int]) -> None:
    """One model step's captured rows -> the store, per request (tokens laid out in the input
    batch's request order, `num_scheduled_tokens` each; vllm/v1/worker/gpu_model_runner.py).
    A request whose rows a MoE router did not write this step (-1) is marked incomplete."""
    for nr in scheduler_output.scheduled_new_reqs:
        store.new_request(nr.req_id, nr.prompt_token_ids or [], nr.num_computed_tokens)
    n = scheduler_output.total_num_scheduled_tokens
    if n:
        cached = scheduler_output.scheduled_cached_reqs
        starts = {nr.req_id: nr.num_computed_tokens for nr in scheduler_output.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        raw = capturer.device_buffer[:n].to(torch.int32).cpu()
        written = (raw[:, moe_layers] >= 0).all(dim=-1).all(dim=-1).numpy() if moe_layers else raw.new_zeros(n).numpy()
        rows = raw.clamp(min=0).numpy().astype(store.dtype)
        off = 0
        for req_id in runner.input_batch.req_ids:
            count = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not count:
                continue
            start = starts[req_id]
            state = runner.requests[req_id]
            tokens = list(state.prompt_token_ids or []) + list(state.output_token_ids)
            if written[off:off + count].all():
                store.record_step(req_id, start, tokens[start:start + count], rows[off:off + count])
            else:
                store.invalidate(req_id)
            off += count
    store.end_step()
    store.finish(scheduler_output.finished_req_ids)
