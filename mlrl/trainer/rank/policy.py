"""`MegatronPolicy`: the trainer's policy on one rank (build, load, logprobs, train step, export).

Runs inside every torchrun rank, SPMD: every method is a collective over all trainer ranks.

    init_parallel(parallel, layout, seed) -> Ranks
    MegatronPolicy(model_cfg, parallel, trainer_cfg, layout, *, hf_dir, trainable=True)
      .compute_logprobs(micro_batches, temperature) -> [(logprobs [S], entropy [S]) per micro-batch]
      .update(micro_batches, loss_fn, *, temperature=1.0) -> metrics dict
      .iter_hf_buckets(bucket_bytes) -> Iterator[list[(hf_name, tensor)]]
      .rank_info() -> dict;  .model / .optimizer / .scheduler;  .sharded_state_dict()

Each DP rank passes its own micro-batches (the ranks of one DP rank's model-parallel group pass
the same list); all DP ranks pass the same number of micro-batches.

Loss normalisation (the contract of mlrl.experience.batch): `loss_fn(mb, logprobs, entropy)`
returns the micro-batch's share of the step loss, already weighted by `mb.loss_weight`, so the
step's gradient is the plain SUM over micro-batches and DP ranks. Megatron by default divides
each micro-batch loss by the number of micro-batches and averages gradients over DP; here
`calculate_per_token_loss=True` removes the division in schedules.forward_step_calc_loss
(the loss function returns (loss, num_tokens, metrics)), makes DDP's gradient scaling factor
1.0 (sum, not average_in_collective), and `finalize_model_grads` is called without num_tokens
so it does not rescale by 1 / tokens: the result is exactly the sum.

Learning rate: optimizer step k (1-based) uses Megatron's OptimizerParamScheduler at
num_steps = k (linear warm-up from 0 reaches trainer.lr at k = trainer.lr_warmup_steps; no step runs at
lr 0); decay over trainer.total_steps * trainer.mini_batches_per_step * trainer.epochs_per_step
optimizer steps (the updates of the whole run; the policy's without the critic-only steps',
Config.policy_updates).

Hooks for models built the same way (mlrl.trainer.rank.critic): `_build_chunks`, `_local_params`,
`_optimizer_hparams`, `_token_values` (the per-token outputs handed to the loss function and
returned by `_forward_token_values`) and `TOKEN_VALUES` (how many per-token outputs there are).
"""

from __future__ import annotations

import contextlib
import json
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, cast

import torch
import torch.distributed as dist

from mlrl.algorithms.loss_metrics import combine_loss_metrics, metric_reduction
from mlrl.bridge import HFCheckpoint, check_layout, spec_for
from mlrl.bridge.arch import is_sequence_classifier
from mlrl.bridge.select import resolve_bridge
from mlrl.config.schema import ModelConfig, ParallelConfig, TrainerConfig
from mlrl.config.validate import Layout
from mlrl.experience.batch import MicroBatch
from mlrl.trainer.rank import cpu_compat, numerics, packed_rope
from mlrl.trainer.rank.inputs import ModelInputs, build_inputs, check_window
from mlrl.trainer.rank.logprobs import align_to_tokens, vocab_parallel_logprobs
from mlrl.trainer.rank.model import build_model_chunks, build_transformer_config, layout_fields, params_dtype
from mlrl.trainer.rank.parallel import Ranks, device, init_parallel, ranks
from mlrl.trainer.rank.weights import LocalParams
from mlrl.weight_sync.sender import bucketize

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import MegatronModule

    from mlrl.trainer.rank.router_replay import Mode

LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]

__all__ = ["MegatronPolicy", "init_parallel", "LossFn"]


class MegatronPolicy:
    role = "policy"  # written into checkpoints: a policy checkpoint never loads into a critic, nor the reverse
    TOKEN_VALUES = 2  # per-token outputs of `_token_values`: (logprob, entropy)
    LM_HEAD = True  # the output layer is the HF lm_head (loaded / exported); the critic's value head is not
    LORA = True  # model.lora adapts this model (the critic trains its full weights)

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, trainer_cfg: TrainerConfig, layout: Layout, *,
                 hf_dir: Path | str, trainable: bool = True, total_updates: Optional[int] = None):
        """`total_updates`: the optimizer updates the LR schedule decays over (default the run's,
        trainer.total_updates; the policy of a run with critic-only steps: Config.policy_updates)."""
        from megatron.core import parallel_state

        self._total_updates = total_updates

        numerics.configure(model_cfg, trainer_cfg)  # before any TE module: determinism / TF32 env
        cpu_compat.apply()
        packed_rope.install()
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("MegatronPolicy: call mlrl.trainer.init_parallel(parallel, layout, seed) first")
        self.trainer_cfg, self.parallel, self.layout, self.trainable = trainer_cfg, parallel, layout, trainable
        self.model_cfg = model_cfg  # model.dtype: the trainer's precision
        self.hf_dir = Path(hf_dir)
        cfg_path = self.hf_dir / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model.hf_dir: {self.hf_dir} has no config.json")
        self.hf_config = json.loads(cfg_path.read_text())
        # model.bridge: mlrl's own bridge, or megatron-bridge for an architecture it lacks (GPU
        # only; the driver's validation resolved the same choice before any process started)
        self.mbridge = None
        if resolve_bridge(model_cfg.bridge, self.hf_config) == "megatron-bridge":
            self._init_mbridge(model_cfg, parallel, trainer_cfg, layout)
            return
        # everything that can be wrong with the input fails here, before any model is built
        self.spec, self.arch = spec_for(self.hf_config)
        check_layout(self.arch, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, cp=layout.cp,
                     vpp=layout.vpp if layout.vpp and layout.vpp > 1 else None, pp_split=parallel.pp_layer_split)
        if layout.vpp and layout.vpp > 1 and cpu_compat.needed():
            raise ValueError(
                f"parallel.vpp={layout.vpp}: the interleaved pipeline schedule hangs on gloo (measured: "
                "PP2 x VPP2 never completes a step on CPU); use vpp on GPU, or pp_layer_split / plain pp here"
            )
        if self.arch.is_moe and layout.tp > 1 and not parallel.sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel must be true for an MoE model with parallel.tp={layout.tp} "
                             "(megatron-core's MoELayer refuses to train otherwise)")
        ckpt = HFCheckpoint(self.hf_dir)
        # a reward model's export (a critic's start): score.weight in place of the LM head
        self.score_head_folder = is_sequence_classifier(self.hf_config)
        if self.score_head_folder and self.LM_HEAD:
            raise ValueError(f"{self.hf_dir} is a sequence classifier (a reward model): it has no LM head to build a "
                             "policy from")
        ckpt.check(self.spec, self.arch, score_head=self.score_head_folder)

        self.ranks: Ranks = ranks()
        self.device = device()
        self.config = build_transformer_config(self.spec, self.arch, model_cfg, parallel, trainer_cfg, layout)
        self.routing = None
        if self.arch.is_moe:  # router replay (R3): every router gets megatron's RouterReplay (inactive by default)
            from mlrl.trainer.rank.router_replay import RouterControl

            self.config.moe_enable_routing_replay = True
            self.routing = RouterControl()
        # "replay": forwards use MicroBatch.routed_experts (algorithm.router_replay)
        self.router_mode: Optional[Mode] = None
        chunks = self._build_chunks()
        self.params = self._local_params(chunks)
        self.params.load_hf(ckpt)
        self._load_head(ckpt, chunks)
        self.lora = None
        if self.LORA and model_cfg.lora is not None:
            from mlrl.trainer.rank.lora import LoRA

            self.lora = LoRA.attach(chunks, model_cfg.lora, config=self.config, tp_rank=self.ranks.tp,
                                    tp_size=self.ranks.tp_size, seed=trainer_cfg.seed)
        self._finish(chunks)

    def _init_mbridge(self, model_cfg: ModelConfig, parallel: ParallelConfig, trainer_cfg: TrainerConfig,
                      layout: Layout) -> None:
        """The megatron-bridge path (mlrl.trainer.rank.mbridge): megatron-bridge builds the chunks
        and maps the weights; DDP, the optimizer and everything after are this class's own.
        `spec` is None on this path (nothing reads mlrl's per-parameter specs)."""
        from mlrl.trainer.rank.mbridge import MBridge, MBridgeParams, generic_arch

        if cpu_compat.needed():
            raise RuntimeError("model.bridge=megatron-bridge needs CUDA and Transformer Engine")
        self.spec, self.arch = None, generic_arch(self.hf_config)
        self.ranks = ranks()
        self.device = device()
        self.mbridge = MBridge(self.hf_dir, layout_fields(self.arch, model_cfg, parallel, trainer_cfg, layout))
        self.config = self.mbridge.config
        self.routing, self.router_mode, self.lora = None, None, None
        chunks = self.mbridge.build_chunks()
        self.params = MBridgeParams(self.mbridge, chunks, self.ranks)
        self.params.load_initial()
        self._finish(chunks)

    def _finish(self, chunks: list[torch.nn.Module]) -> None:
        """DDP + optimizer (trainable) or a frozen eval model: the same on both bridge paths."""
        self.optimizer = self.scheduler = None
        if self.trainable:
            self.model: list[MegatronModule] = self._wrap_ddp(chunks)  # GPTModel chunks, DDP-wrapped
            self._build_optimizer()
        else:
            for c in chunks:
                c.requires_grad_(False)
                c.eval()
            self.model = cast("list[MegatronModule]", chunks)
        self.optimizer_steps = 0

    # ---- construction ----------------------------------------------------------------------------
    def _build_chunks(self) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks, before DDP (hook: the critic swaps in its value head)."""
        assert self.spec is not None  # None only on the megatron-bridge path, which builds its own chunks
        return build_model_chunks(self.spec, self.arch, self.config, self.layout,
                                  unfused_norms=self.LORA and self.model_cfg.lora is not None)

    def _load_head(self, ckpt: HFCheckpoint, chunks: list[torch.nn.Module]) -> None:
        """Hook: an output layer that is not the HF lm_head (the critic's value head) from the folder,
        into `chunks` (before DDP wraps them)."""

    def _local_params(self, chunks: list[torch.nn.Module]) -> LocalParams:
        """The parameters that load from / export to the HF checkpoint (without the output layer
        when it is not the HF lm_head: `LM_HEAD`)."""
        assert self.spec is not None  # None only on the megatron-bridge path (MBridgeParams)
        return LocalParams(chunks, self.spec, self.arch, self.ranks,
                           vpp=self.config.virtual_pipeline_model_parallel_size,
                           pp_split=self.parallel.pp_layer_split, lm_head=self.LM_HEAD)

    def _optimizer_hparams(self) -> dict[str, Any]:
        """Learning-rate schedule and regularisation of this model's optimizer (hook: the critic has its own)."""
        t = self.trainer_cfg
        return dict(lr=t.lr, min_lr=t.min_lr, lr_schedule=t.lr_schedule, lr_warmup_steps=t.lr_warmup_steps,
                    weight_decay=t.weight_decay, grad_clip=t.grad_clip)

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[MegatronModule]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=self.trainer_cfg.use_distributed_optimizer, average_in_collective=False)
        model = [DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
                 for i, c in enumerate(chunks)]

        def finalize(model_chunks, num_tokens=None, *args, **kwargs):
            # num_tokens dropped on purpose: gradients are sums of pre-normalised losses
            return finalize_model_grads(model_chunks, None, *args, **kwargs)

        self.config.finalize_model_grads_func = finalize
        # one no_sync per chunk with VPP: megatron's schedules accept a list (the field is typed as one callable)
        self.config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync  # pyright: ignore[reportAttributeAccessIssue]
        return cast("list[MegatronModule]", model)

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t, h = self.trainer_cfg, self._optimizer_hparams()
        dtype = params_dtype(self.model_cfg)
        opt_cfg = OptimizerConfig(
            optimizer=t.optimizer, lr=h["lr"], min_lr=h["min_lr"], weight_decay=h["weight_decay"],
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            # grad_clip 0 = off; a huge threshold keeps Megatron computing (and returning) the norm
            clip_grad=h["grad_clip"] if h["grad_clip"] > 0 else 1e30,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=t.use_distributed_optimizer)
        with cpu_compat.cuda_tensor_methods():
            self.optimizer = get_megatron_optimizer(opt_cfg, self.model)
        self.config.grad_scale_func = self.optimizer.scale_loss
        total = max(1, t.total_updates if self._total_updates is None else self._total_updates)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=h["lr"], min_lr=h["min_lr"], lr_warmup_steps=h["lr_warmup_steps"],
            lr_decay_steps=max(total, h["lr_warmup_steps"]), lr_decay_style=h["lr_schedule"],
            start_wd=h["weight_decay"], end_wd=h["weight_decay"], wd_incr_steps=total, wd_incr_style="constant")

    # ---- forward ---------------------------------------------------------------------------------
    def _inputs(self, micro_batches: list[MicroBatch]) -> list[ModelInputs]:
        out = []
        for mb in micro_batches:
            check_window(mb, self.arch.sliding_window)
            out.append(
                build_inputs(
                    mb,
                    self.device,
                    tp=self.layout.tp,
                    sequence_parallel=self.parallel.sequence_parallel,
                    cp=self.layout.cp,
                    cp_rank=self.ranks.cp,
                    fp8_recipe=self.trainer_cfg.fp8_recipe,
                )
            )
        return out

    def _token_values(self, output: torch.Tensor, inp: ModelInputs, temperature: float) -> tuple[torch.Tensor, ...]:
        """GPTModel output (vocab-parallel logits [1, S', V/tp]) -> (logprobs [S], entropy [S])."""
        from megatron.core import parallel_state as ps

        lp, ent = vocab_parallel_logprobs(
            output[0],
            inp.labels,
            temperature=temperature,
            vocab_size=self.arch.vocab_size,
            tp_rank=self.ranks.tp,
            tp_size=self.ranks.tp_size,
            tp_group=ps.get_tensor_model_parallel_group(),
        )
        return self._align_to_tokens(inp, lp, ent)

    def _align_to_tokens(self, inp: ModelInputs, *per_position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Values of the prediction made at each position of this rank's row [S'] (its CP slice on
        GPU) -> token-aligned [S] (`align_to_tokens`: first token of each sample and padding 0)."""
        mask = inp.label_mask
        values = per_position
        if inp.cp_index is not None:
            *values, mask, index = (_cp_gather(x) for x in (*values, mask, inp.cp_index))
            keep = index >= 0
            *values, mask = [torch.zeros(inp.length, dtype=x.dtype, device=x.device).index_put((index[keep],), x[keep])
                              for x in (*values, mask)]
        return tuple(align_to_tokens(x, mask)[: inp.length] for x in values)

    def _run(self, micro_batches: list[MicroBatch], inputs: list[ModelInputs], loss_func, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        items = list(zip(micro_batches, inputs))
        if len(self.model) > 1 and len(items) < self.layout.pp:
            raise ValueError(f"parallel.vpp={len(self.model)}: the interleaved pipeline schedule needs at least "
                             f"pp={self.layout.pp} micro-batches per DP rank, got {len(items)}")

        routing = self.routing if self.routing is not None and self.routing.mode else None
        sp = self.parallel.sequence_parallel and self.layout.tp > 1

        def forward_step(data_iterator, model):
            mb, inp = next(data_iterator)
            if routing is not None:
                routing.before_forward(model, mb.routed_experts, padded_len=int(inp.tokens.shape[1]),
                                       sp_rank=self.ranks.tp if sp else 0, sp_size=self.layout.tp if sp else 1)
            out = model(inp.tokens, inp.position_ids, attention_mask=None, packed_seq_params=inp.packed_seq_params)
            if routing is not None:
                routing.after_forward(model)
            return out, partial(loss_func, mb, inp)

        iters = [iter(items) for _ in self.model] if len(self.model) > 1 else iter(items)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=cast("list[torch.nn.Module]", self.model) if len(self.model) > 1 else self.model[0],
            num_microbatches=len(items),
            seq_length=max(i.tokens.shape[1] for i in inputs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def compute_logprobs(
        self, micro_batches: list[MicroBatch], temperature: float, *,
        router: Optional[Mode | Literal["default"]] = "default"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logprobs [S], entropy [S]) per micro-batch (token-aligned, first token of each sample
        and padding 0), on every rank of this DP rank's model-parallel group. `router` (MoE):
        "default" = `self.router_mode`; "replay" / None; "record" = the trainer's own routing,
        compared with the engine's (`router_agreement_counts`)."""
        with self._routing(router):
            values = self._forward_token_values(micro_batches, temperature)
        return cast("list[tuple[torch.Tensor, torch.Tensor]]", values)  # TOKEN_VALUES = 2: (logprob, entropy)

    def _routing(self, router: Optional[Mode | Literal["default"]]):
        mode = self.router_mode if router == "default" else router
        if self.routing is None:
            if mode is not None:
                raise ValueError(f"router mode {mode!r} on a model without MoE layers")
            return contextlib.nullcontext()
        return self.routing.active(mode)

    def router_agreement_counts(self) -> tuple[int, int]:
        """(matching, compared) token-layer top-k sets of the last "record" pass, summed over every
        rank (DP ranks hold other micro-batches, TP ranks other sequence-parallel slices, PP stages
        other layers)."""
        if self.routing is None:
            return 0, 0
        t = torch.tensor([self.routing.matches, self.routing.compared], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return int(t[0]), int(t[1])

    def _forward_token_values(
        self, micro_batches: list[MicroBatch], temperature: float
    ) -> list[tuple[torch.Tensor, ...]]:
        """`_token_values` of each micro-batch (forward only, fp32, on CPU), on every rank of this
        DP rank's model-parallel group."""
        if not micro_batches:
            return []
        inputs = self._inputs(micro_batches)
        zero = torch.zeros((), device=self.device)

        def loss_func(mb, inp, output):
            values = self._token_values(output, inp, temperature)
            return (
                zero,
                torch.tensor(0, dtype=torch.int, device=self.device),
                {str(i): v.detach() for i, v in enumerate(values)},
            )

        for m in self.model:
            m.eval()
        with torch.no_grad():
            store = self._run(micro_batches, inputs, loss_func, forward_only=True)
        return self._broadcast_from_last_stage(store, [mb.num_tokens for mb in micro_batches])

    def compute_logits(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Full-vocabulary logits [S, vocab] per micro-batch (TP-gathered, fp32, no temperature),
        on every rank of this DP rank's model-parallel group. For parity checks and tools; the
        training path never materialises full-vocabulary logits."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        if self.layout.cp > 1:
            raise NotImplementedError("compute_logits with context parallelism")
        inputs = self._inputs(micro_batches)
        zero = torch.zeros((), device=self.device)
        V = self.arch.vocab_size

        def loss_func(mb, inp, output):
            full = gather_from_tensor_model_parallel_region(output)[0, : inp.length, :V].float()
            return zero, torch.tensor(0, dtype=torch.int, device=self.device), {"logits": full}

        for m in self.model:
            m.eval()
        with torch.no_grad():
            store = self._run(micro_batches, inputs, loss_func, forward_only=True)
        out = []
        for i, mb in enumerate(micro_batches):
            t = store[i]["logits"].contiguous() if self.ranks.is_last_stage else \
                torch.empty(mb.num_tokens, V, dtype=torch.float32, device=self.device)
            if self.ranks.pp_size > 1:
                from megatron.core import parallel_state as ps

                dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=_pp_group())
            out.append(t.cpu())
        return out

    def _broadcast_from_last_stage(self, store: list[dict], lengths: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """The last stage's per-micro-batch outputs {"0": [S], "1": [S], ...} (TOKEN_VALUES of
        them) -> a tuple per micro-batch on every stage."""
        from megatron.core import parallel_state as ps

        r, k = self.ranks, self.TOKEN_VALUES
        if r.is_last_stage:
            flat = torch.cat([torch.cat([d[str(i)] for i in range(k)]) for d in store]).float()
        else:
            flat = torch.empty(k * sum(lengths), dtype=torch.float32, device=self.device)
        if r.pp_size > 1:
            dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=_pp_group())
        flat = flat.cpu()  # one device->host copy (and sync) for the whole call, not one per value
        out, off = [], 0
        for n in lengths:
            out.append(tuple(flat[off + i * n:off + (i + 1) * n] for i in range(k)))
            off += k * n
        return out

    # ---- train -----------------------------------------------------------------------------------
    def update(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, temperature: float = 1.0,
                   step: bool = True) -> dict[str, float]:
        """One optimizer step over this DP rank's micro-batches. Returns (identical on every rank)
        loss and loss_fn metrics summed over micro-batches and DP ranks, grad_norm (before
        clipping), lr, tokens / loss_tokens (whole step), time_s, skipped (fp16 overflow).
        `temperature` must be the sampling temperature (logprobs of the sampled distribution).
        `step=False` stops after the backward pass and gradient reduction (gradient checks:
        `iter_hf_buckets(grads=True)`); the LR schedule does not advance then."""
        from megatron.core import parallel_state as ps

        if self.optimizer is None or self.scheduler is None:  # both built together
            raise RuntimeError("update on a frozen policy (trainable=False)")
        t0 = time.perf_counter()
        inputs = self._inputs(micro_batches)
        for m in self.model:
            m.train()
            cast("DistributedDataParallel", m).zero_grad_buffer()  # trainable: DDP-wrapped
        self.optimizer.zero_grad()
        if step:
            self.scheduler.step(1)

        def loss_func(mb, inp, output):
            loss, metrics = loss_fn(mb.to(self.device), *self._token_values(output, inp, temperature))
            reported = {"loss": loss.detach().float()}
            reported.update(
                {k: torch.as_tensor(v, dtype=torch.float32, device=self.device).detach() for k, v in metrics.items()}
            )
            return loss, torch.tensor(int(mb.loss_mask.sum()), dtype=torch.int, device=self.device), reported

        t_fb = time.perf_counter()
        with self._routing("default"):
            store = self._run(micro_batches, inputs, loss_func, forward_only=False)
        t_opt = time.perf_counter()
        ok, grad_norm = True, None
        if step:
            with cpu_compat.cuda_tensor_methods():
                # MegatronOptimizer.step is an abstract `pass`; every optimizer returns (ok, grad norm, zeros)
                ok, grad_norm, _ = cast("tuple[bool, Optional[float], Optional[int]]", self.optimizer.step())
            self.optimizer_steps += 1
        t_done = time.perf_counter()

        # each key reduced its own way (loss_metrics.metric_reduction): sums, and the _max / _min keys
        # (e.g. ratio_max) by max / min, over micro-batches and DP ranks; the last stage's reach every stage
        combined = combine_loss_metrics(store)
        keys = self._broadcast_keys(sorted(combined))
        last = self.ranks.pp_size == 1 or self.ranks.is_last_stage
        by_how = {how: [k for k in keys if metric_reduction(k) == how] for how in ("sum", "max", "min")}
        parts: dict[str, torch.Tensor] = {}
        for how, ks in by_how.items():
            extra = 2 if how == "sum" else 0  # + tokens, loss tokens
            t = torch.zeros(len(ks) + extra, dtype=torch.float64, device=self.device)
            if last and ks:
                t[: len(ks)] = torch.stack([combined[k].to(self.device) for k in ks])
            parts[how] = t
        parts["sum"][-2] = float(sum(int(mb.cu_seqlens[-1]) for mb in micro_batches))
        parts["sum"][-1] = float(sum(float(mb.loss_mask.sum()) for mb in micro_batches))
        if self.ranks.dp_size > 1:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            for how, t in parts.items():
                if t.numel():
                    dist.all_reduce(t, op=ops[how], group=ps.get_data_parallel_group())
        if self.ranks.pp_size > 1:
            for t in parts.values():
                if t.numel():
                    dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=_pp_group())
        sums = parts["sum"]
        metrics = {k: float(v) for how, ks in by_how.items() for k, v in zip(ks, parts[how].tolist())}
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            tokens=float(sums[-2]), loss_tokens=float(sums[-1]),
            num_micro_batches=float(len(micro_batches)), skipped=float(not ok),
            forward_backward_s=t_opt - t_fb, optimizer_s=t_done - t_opt, time_s=time.perf_counter() - t0)
        return metrics

    def _broadcast_keys(self, keys: list[str]) -> list[str]:
        if self.ranks.pp_size == 1:
            return keys
        from megatron.core import parallel_state as ps

        obj = [keys]
        dist.broadcast_object_list(obj, src=ps.get_pipeline_model_parallel_last_rank(), group=_pp_group())
        return obj[0]

    # ---- export / checkpoint hooks -----------------------------------------------------------------
    def iter_hf_buckets(self, bucket_bytes: int, *, grads: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of ~bucket_bytes. A collective: every trainer rank
        calls it and exhausts the iterator; only the sender of each pipeline stage (tp 0, dp 0,
        cp 0: `rank_info()['is_stage_sender']`) yields, and it yields exactly its stage's
        tensors (embedding on the first stage, final norm / lm_head on the last, the stage's
        layers with all experts). Tensors may alias parameters until the next optimizer step.
        `grads=True` yields the accumulated gradients instead (Megatron's main_grad; complete
        after a `update(step=False)` without the distributed optimizer, which leaves each
        DP rank only its own reduced shard).
        With LoRA the adapted weights are W + (alpha / r) B A, computed into new tensors (the
        frozen base is untouched): the merged model, e.g. for a weight sync into plain engines."""
        if self.lora is None:
            yield from bucketize(self.params.iter_hf(grads=grads), bucket_bytes)
            return
        if grads:
            raise ValueError("iter_hf_buckets(grads=True) with LoRA: the frozen base has no gradients")
        full = {spec.base_hf_name(): (a, b) for spec, a, b in self.lora.full_adapters(self.ranks)}
        yield from bucketize(self.lora.merge_into(self.params.iter_hf(), full), bucket_bytes)

    def iter_adapters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: the LoRA adapters of this rank's stage as peft-named full tensors
        (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), on the stage sender."""
        if self.lora is None:
            raise ValueError("iter_adapters: this policy has no LoRA adapters (model.lora is off)")
        for spec, a, b in self.lora.full_adapters(self.ranks):
            yield spec.hf_name("A"), a
            yield spec.hf_name("B"), b

    def gather_adapters(self) -> dict[str, torch.Tensor] | None:
        """Collective: every stage's adapters (`iter_adapters`) on global rank 0, None elsewhere.
        Small (r * (in + out) per adapted layer), so the stage senders pickle theirs to rank 0."""
        local = {n: t.detach().cpu().clone() for n, t in self.iter_adapters()}
        if self.ranks.world == 1:
            return local
        parts: Optional[list[Any]] = [None] * self.ranks.world if self.ranks.rank == 0 else None
        dist.gather_object(local, parts, dst=0)
        if parts is None:  # not rank 0
            return None
        return {n: t for part in parts for n, t in part.items()}

    def rank_info(self) -> dict[str, Any]:
        info = self.ranks.as_dict()
        info.update(dp_rank=self.ranks.dp, is_stage_sender=self.ranks.is_stage_sender)
        return info

    def sharded_state_dict(self, *, is_loading: bool = False, metadata: Optional[dict] = None) -> dict[str, Any]:
        """Megatron's sharded state dicts for dist_checkpointing: {"model" or "model<i>": ...,
        "optimizer": ..., "scheduler": ...} (optimizer / scheduler only when trainable). Megatron's
        optimizer has state only after its first step: loading into a fresh policy needs the state
        initialised first (DESIGN.md: dummy state init before loading; per-parameter `step`)."""
        if len(self.model) == 1:
            sd: dict[str, Any] = {"model": self.model[0].sharded_state_dict()}
        else:
            sd = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(self.model)}
        if self.optimizer is not None and self.scheduler is not None:  # both built together (trainable)
            # dp_reshardable: the layout that loads back under another DP size and works with
            # gloo (the default fully_sharded_model_space needs flattened_range support)
            meta = {"distrib_optim_sharding_type": "dp_reshardable", **(metadata or {})}
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
            sd["scheduler"] = self.scheduler.state_dict()
        return sd


def _cp_gather_nograd(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    group = cast("dist.ProcessGroup", ps.get_context_parallel_group())  # unannotated getter
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


class _CPGatherFn(torch.autograd.Function):
    """All-gather along dim 0 over the context-parallel group; backward keeps this rank's slice
    (the loss is computed identically on every CP rank, so no gradient is summed)."""

    @staticmethod
    def forward(ctx, x):
        from megatron.core import parallel_state as ps

        ctx.rank, ctx.n = ps.get_context_parallel_rank(), x.shape[0]
        return _cp_gather_nograd(x)

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]  # torch's is (ctx, *grad_outputs)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def _pp_group() -> dist.ProcessGroup:
    """Megatron's pipeline-parallel group (its getter is unannotated; a list only for ranks in
    several PP groups, which mlrl's layouts never make)."""
    from megatron.core import parallel_state as ps

    return cast("dist.ProcessGroup", ps.get_pipeline_model_parallel_group())


def _cp_gather(x: torch.Tensor) -> torch.Tensor:
    """GPU only (context parallel): this CP rank's per-token values -> the whole padded row."""
    return _CPGatherFn.apply(x) if x.is_floating_point() else _cp_gather_nograd(x)
