"""Per-GPU memory estimates for trainer ranks and vLLM engines (bytes; the planner prints GiB).

These are planning estimates, not measurements: they decide whether a layout can fit before any
GPU is touched. Every term, its source, and where we depart from the source:

Parameters, gradients, optimizer state (Megatron-Core "Distributed Optimizer" guide,
docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html): bytes per
parameter, d = data-parallel size of that parameter's optimizer shard,
    precision  params  grads(main, fp32 for bf16)  Adam state (fp32 master + m + v)
    fp32         4        4                         8   (no separate master copy)
    bf16         2        4                        12
    fp16         2        2                        16   (the guide's 20 / 4 + 16/d)
The optimizer column is divided by d with `use_distributed_optimizer` (grads and params are not
sharded by it). d is dp*cp for dense parameters and the expert-data-parallel size
world/(pp*ep*etp) for expert parameters (Megatron shards expert state over the expert-DP group).
SGD keeps one fp32 momentum instead of Adam's two moments (4 bytes less per parameter).
Parameters per rank: attention and MLP weights divided by TP, embedding / output layer divided by
TP (vocab-parallel) on the first / last pipeline stage, norms and the MoE router replicated,
experts divided by EP (experts per rank) and ETP (inside an expert).
FP8 (trainer.fp8_recipe): Transformer Engine keeps the bf16 parameters and caches an FP8 copy of
each linear weight: +1 byte per linear parameter (FP8 activations are not credited: conservative).
A reference model (algorithm.kl_coef > 0) adds one more copy of the parameters (none with LoRA), or
a teacher's parameters (algorithm.reference_hf_dir, sized as its own model).

LoRA (model.lora, mlrl.trainer.rank.lora): the base is frozen (requires_grad=False before
Megatron's DDP and optimizer are built), so a base parameter keeps only the params column: no
main gradient, no Adam state, no fp32 master copy. The adapters, A [r, in] and B [out, r] per
adapted linear and layer, are trained parameters in the params dtype and take the whole row of
the table, their optimizer state sharded over dp*cp like any dense parameter. Per TP rank (t) an
adapter holds r * (in + out / t) on a column-parallel linear (q/k/v/gate/up: B split with the
output, A replicated) and r * (in / t + out) on a row-parallel one (o/down: A split with the
input, B replicated); MoE layers carry attention adapters only. The reference model is free (it
is the base with the adapters off) and the FP8 cache covers the base linears only (the adapters
run in the params dtype).

Critic (`critic:` section, PPO + GAE): a value model with the policy's architecture (or the model
`critic.hf_dir` names: its own shape) on the same
trainer ranks and the same parallel layout, trained by its own optimizer of the policy's kind,
precision and sharding. Per rank it holds the policy's parameters minus the output layer (no
vocabulary projection: the last stage has a replicated h x 1 value head instead, h elements),
and it keeps its own gradients and optimizer state: its params + grads + optimizer (+ the FP8
weight cache under FP8) are computed with the table above and added to the rank's total as a
separate term. Its activations are not added: the critic's forward / backward passes run at
other times than the policy's (values before the policy update, the value loss after it), so the
peak is the larger of the two, and with the policy's architecture the critic's is the smaller one
(the same layers without the vocabulary-sized logits, under the same micro-batch token budget);
a critic of its own model is sized as well and the larger pass counts (mlrl.plan.planner).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, Sec. 4): per layer and token the paper stores
sbh(34 + 5as/h) bytes in 16-bit, with TP t and sequence parallelism sbh(34/t + 5as/(ht)),
selective recomputation (recompute the attention core) sbh*34/t, and full recomputation only the
layer input 2sbh (16-bit). We keep the paper's term-by-term derivation but adapt the terms to
GQA, gated MLPs and no dropout (Qwen/Llama have none), with B bytes per activation element:
    replicated unless sequence parallel: two norm inputs + QKV input + MLP input   4 h B
    sharded by TP: Q, K, V and the attention output (out-proj input)               (2q + 2kv) B / t
    gated MLP: gate+up output (2f) and the activation output (f)                    3 f B / t
    MoE MLP instead: each token visits top-k experts: k (h + 3 f_e / etp) B, the router's
        fp32 probabilities 4 E (both divided by t with sequence parallelism)
    attention scores, softmax output (unfused attention only)                       a s B / t
On GPU the Transformer Engine spec uses flash attention, which stores no s x s scores: the last
term is 0 there, so `selective` (Megatron's default recompute module is the attention core)
saves little on GPU; `full` stores only the layer input (h B, / t with SP) plus one layer's
working set during its recomputation.
Pipeline: with 1F1B, stage k holds min(pp - k, micro-batches) micro-batches in flight (the
paper's Sec. 4.2.3: the first stage holds pp of them); the interleaved schedule multiplies by
(1 + (pp - 1) / (pp * vpp)). The last stage adds the output layer: logits (B) and their fp32
log-softmax (4) per vocabulary entry, V (B + 4) / t per token (the paper counts 4 sbv/t).
Context parallelism divides the tokens of a micro-batch by cp.
LoRA adds per token and layer what the adapters keep for their backward: h = A x, r elements
per adapted module (r / t on a row-parallel linear with sequence parallelism, where h is
reduce-scattered over the sequence). Their input is the base linear's, already counted, except
with model.lora.dropout > 0: then each adapted linear keeps a dropped copy of its input and the
1-byte mask, (B + 1) * in (in / t where the input is TP-sharded: row-parallel, or with SP).

vLLM engines reserve gpu_memory_utilization * GPU memory and split it into weights (params /
engine_tp in model.dtype), a profiled activation peak (estimated here from a forward pass of
max_num_batched_tokens tokens plus the fp32 logits of max_num_seqs sequences, at the API server's
defaults for the GPU's memory, `vllm_batch_defaults`: 2048 / 256 below 70 GiB, 8192 / 1024 from 70,
16384 / 1024 from 160; mlrl sets neither), CUDA context/NCCL
(1 GiB), CUDA graphs (0.5 GiB unless enforce_eager) and the KV cache, which gets the rest:
2 (K and V) * layers * kv_heads/engine_tp * head_dim * B bytes per token. vLLM refuses to start
when the KV cache cannot hold one sequence of max_model_len tokens.
With weight_sync.lora_mode=adapter the engines run with --enable-lora --max-loras 2
--max-lora-rank R (mlrl.rollout.server; R: the smallest rank vLLM accepts >= model.lora.rank),
and before profiling vLLM allocates both slots at rank R on every linear it supports, whatever
model.lora.target_modules says, each routed expert of a MoE layer included (vllm/lora/layers:
A [R, in], B [out, R], column B / row A split over engine_tp), in model.dtype: that comes off the
KV cache. vLLM's embedding / logits LoRA buffers, about (V + h) R each, are not counted.

Colocated placement (cluster.colocate) time-shares a GPU between a trainer rank and an engine rank.
One RL step goes through three phases, and the GPU must hold the largest (`colocated_phases`):
    rollout  the engine is awake: its whole budget (weights, LoRA slots, activations, runtime, KV
             cache). The trainer keeps its CUDA context and, unless offload_params, its weights:
             the policy's, the KL reference's and the critic's parameters. Gradients are released
             (not copied: every step zeroes them) and the optimizer state (Adam moments and fp32
             master copies) sits in host memory (mlrl.trainer.rank.offload); with offload_params
             the parameters go to host memory too.
    train    the engine sleeps and keeps only its runtime (CUDA context, NCCL, the CUDA-graph pool:
             vLLM's sleep frees the weights and the KV cache only, vllm-project/vllm#56373); the
             trainer holds its whole footprint (`TrainerMemory.total`: activations, reference and
             critic included).
    sync     optimizer state and gradients are offloaded again, the engine wakes its weights only
             (no KV cache, no activations), both copies of the weights are resident, plus the
             transport's buffers (`sync_buffers`).
Start-up needs no phase of its own: the engines start alone and sleep before the trainer ranks
build (mlrl.colocation), so the GPU holds at most the rollout phase, then at most the train phase.
TE's FP8 weight cache is not a parameter (the offloader moves parameter, gradient and optimizer
storages only): it stays resident in every phase. vLLM's sleep level changes host memory, not GPU
memory: level 1 copies the engine's weights (and LoRA slots) to host memory for the train phase,
level 2 discards them (the sync rewrites them). Host memory is reported per node, not checked:
the config has no host capacity.

Transport buffers in the sync phase, L = the largest full HF tensor (the embedding, V h, in
model.dtype) and b = weight_sync.bucket_mb: a stage's sender (tp 0, dp 0, cp 0) fills one bucket
while the next tensor is all-gathered over TP (its pieces plus the concatenation), b + 2L; the
other ranks hold their share of that gather, 2L (charged to every one of them, dp > 0 included,
which gather nothing). cuda_ipc senders keep every exported tensor of their stage alive until
the engines have loaded them: the stage's full (TP- and EP-gathered) weights instead of b, and
the engines map them without a copy. broadcast receivers hold up to 4 buckets (receive_all's
queue of 2, one being received, one being loaded), and a tensor larger than b (the embedding,
the untied output layer) is a bucket of its own: 4 b + n (L - b)+. disk receivers read into host
memory, and the adapter sync (weight_sync.lora_mode=adapter) moves only the adapters (MiBs): 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from mlrl.config.schema import LORA_TARGETS, LoRAConfig
from mlrl.plan.model import LORA_LINEAR, LORA_ROW, ModelShape

GIB = float(1024**3)

# (param bytes, main-grad bytes, Adam-state bytes) per parameter, from the Megatron guide above.
PRECISION_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 2, 16)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_RUNTIME_GIB = 1.0        # CUDA context, cuBLAS workspace, NCCL buffers: typically 0.5-1.5 GiB
CUDA_GRAPHS_GIB = 0.5         # vLLM CUDA-graph pool when enforce_eager is off
ENGINE_LORA_SLOTS = 2         # --max-loras of mlrl.rollout.server (the newest adapter and the one before)


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one trainer rank of a pipeline stage, in elements."""

    dense: int      # everything except routed experts (sharded over dp*cp by the dist. optimizer)
    expert: int     # routed-expert weights (sharded over the expert-DP group)
    linear: int     # weights of linear layers (what FP8 caches)
    adapter: int = 0  # LoRA A and B (0 = no LoRA); when > 0 they are the only trained parameters

    @property
    def total(self) -> int:
        return self.dense + self.expert + self.adapter

    @property
    def trained(self) -> tuple[int, int]:
        """(dense, expert) parameters with gradients and optimizer state: the adapters under LoRA."""
        return (self.adapter, 0) if self.adapter else (self.dense, self.expert)


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes per trainer GPU of one pipeline stage for one trained model's weights and training
    state (used for the critic, whose activations are not counted: see the module docstring)."""

    params: float
    grads: float
    optimizer: float
    fp8_weights: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.fp8_weights

    def parts(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "fp8": self.fp8_weights}


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes per trainer GPU of one pipeline stage."""

    params: float
    grads: float
    optimizer: float
    fp8_weights: float
    reference: float
    activations: float
    runtime: float
    critic: ModelStateMemory | None = None     # None: no critic in this run

    @property
    def critic_bytes(self) -> float:
        return self.critic.total if self.critic is not None else 0.0

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.fp8_weights + self.reference + self.activations
                + self.runtime + self.critic_bytes)

    def parts(self) -> dict[str, float]:
        out = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "fp8": self.fp8_weights,
               "reference": self.reference, "activations": self.activations, "runtime": self.runtime}
        if self.critic is not None:
            out["critic"] = self.critic.total
        return out

    def weights(self) -> dict[str, float]:
        """The parameters of every model on the rank (policy, KL reference, critic): what
        cluster.colocate.offload_params moves to host memory while the engines generate."""
        out = {"trainer params": self.params, "reference": self.reference}
        if self.critic is not None:
            out["critic params"] = self.critic.params
        return out

    @property
    def fp8_cache(self) -> float:
        """TE's FP8 weight copies, the policy's and the critic's (resident in every phase)."""
        return self.fp8_weights + (self.critic.fp8_weights if self.critic is not None else 0.0)

    @property
    def optimizer_state(self) -> float:
        """Optimizer state of the policy and the critic: in host memory outside the train phase."""
        return self.optimizer + (self.critic.optimizer if self.critic is not None else 0.0)


@dataclass(frozen=True)
class EngineMemory:
    """Bytes per engine GPU (one TP rank of one engine)."""

    budget: float          # gpu_memory_utilization * GPU memory: what vLLM takes
    weights: float
    activations: float
    runtime: float         # CUDA context + graphs
    kv_cache: float        # budget - the rest (negative = does not fit)
    kv_bytes_per_token: float
    max_model_len: int
    lora: float = 0.0      # vLLM's LoRA slots (weight_sync.lora_mode=adapter; 0 = --enable-lora off)

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache // self.kv_bytes_per_token))


def stage_layers(layers: int, pp: int, vpp: int | None, split: list[int] | None) -> list[list[int]]:
    """Layer indices held by each pipeline rank (with vpp, rank k holds chunks k, k+pp, ...)."""
    if split is not None:
        out, start = [], 0
        for n in split:
            out.append(list(range(start, start + n)))
            start += n
        return out
    v = vpp if vpp and vpp > 1 else 1
    chunk = layers // (pp * v)
    out = [[] for _ in range(pp)]
    for c in range(pp * v):
        out[c % pp].extend(range(c * chunk, (c + 1) * chunk))
    return out


def stage_params(shape: ModelShape, layers: list[int], *, first: bool, last: bool, pp: int,
                 tp: int, ep: int, etp: int, value_head: bool = False, lora: LoRAConfig | None = None) -> StageParams:
    """Parameters per rank of one pipeline stage; `value_head`: the critic's, whose last stage has
    a scalar value head (h x 1, replicated under TP) instead of the output layer; `lora`: the
    adapters added to a frozen base (the policy's)."""
    dense = linear = expert = adapter = 0
    for i in layers:
        if lora is not None:
            adapter += shape.lora_layer_params(i, lora.rank, lora.targets, tp=tp)
        attn = shape.attention_params() // tp
        dense += attn + shape.norm_params()
        linear += attn
        if shape.moe_layer[i]:
            shared = shape.shared_expert_params() // tp
            dense += shape.router_params() + shared
            linear += shared
            per_rank = (shape.experts // ep) * (shape.expert_params() // etp)
            expert += per_rank
            linear += per_rank
        else:
            mlp = shape.dense_mlp_params() // tp
            dense += mlp
            linear += mlp
    emb = shape.embedding_params() // tp
    if first:
        dense += emb
    if last:
        dense += shape.hidden  # final norm
        if value_head:
            dense += shape.hidden
        elif not shape.tied or pp > 1:  # untied output layer, or the tied copy on the last stage
            dense += emb
    return StageParams(dense, expert, linear, adapter)


def lora_activation_bytes(shape: ModelShape, i: int, lora: LoRAConfig, *, act_bytes: int, tp: int,
                          sp: bool) -> float:
    """Bytes per token the adapters of layer i store for their backward (see the module docstring)."""
    tok = tp if sp else 1
    targets = shape.lora_layer_targets(i, lora.targets)
    out = sum(lora.rank * act_bytes / (tok if m in LORA_ROW else 1) for m in targets)
    if lora.dropout > 0:
        inputs = {LORA_LINEAR[m]: shape.lora_dims(m)[0] / (tp if m in LORA_ROW else tok) for m in targets}
        out += (act_bytes + 1) * sum(inputs.values())
    return out


def layer_activation_bytes(shape: ModelShape, moe: bool, *, act_bytes: int, tp: int, etp: int, sp: bool,
                           flash: bool, recompute: str, seq_len: int) -> float:
    """Bytes stored per token for one layer's backward (no recomputation of that layer), LoRA aside."""
    b, h = act_bytes, shape.hidden
    tok = tp if sp else 1
    replicated = 4 * h * b / tok
    attention = (2 * shape.q_width + 2 * shape.kv_width) * b / tp
    scores = 0.0 if (flash or recompute != "none") else shape.heads * seq_len * b / tp
    if moe:
        mlp = (shape.top_k * (h + 3 * shape.expert_ffn / etp) * b + 4 * shape.experts) / tok
        mlp += 3 * shape.shared_expert_ffn * b / tp
    else:
        mlp = 3 * shape.ffn * b / tp
    return replicated + attention + scores + mlp


def inflight_microbatches(stage: int, pp: int, vpp: int | None, micro_batches: int) -> float:
    n = min(pp - stage, micro_batches)
    if vpp and vpp > 1:
        n *= 1 + (pp - 1) / (pp * vpp)
    return n


def stage_activation_bytes(shape: ModelShape, layers: list[int], *, last: bool, tokens: float, inflight: float,
                           act_bytes: int, tp: int, etp: int, sp: bool, flash: bool, recompute: str,
                           seq_len: int, lora: LoRAConfig | None = None) -> float:
    per_layer = [layer_activation_bytes(shape, shape.moe_layer[i], act_bytes=act_bytes, tp=tp, etp=etp, sp=sp,
                                        flash=flash, recompute=recompute, seq_len=seq_len)
                 + (lora_activation_bytes(shape, i, lora, act_bytes=act_bytes, tp=tp, sp=sp) if lora else 0.0)
                 for i in layers]
    if recompute == "full":
        kept = len(layers) * shape.hidden * act_bytes / (tp if sp else 1)
        working = max(per_layer, default=0.0)
        acts = tokens * (kept * inflight + working)
    else:
        acts = tokens * sum(per_layer) * inflight
    if last:
        acts += tokens * shape.vocab * (act_bytes + 4) / tp
    return acts


def model_state_memory(p: StageParams, *, precision: str, optimizer: str, distributed_optimizer: bool, dp_cp: int,
                        edp: int, fp8: bool) -> ModelStateMemory:
    """Parameters, main gradients, optimizer state and FP8 weight cache of one trained model
    (the policy's or the critic's), per the table in the module docstring: all parameters are
    resident, only the trained ones (the adapters under LoRA) have gradients and optimizer state."""
    pb, gb, ob = PRECISION_BYTES[precision]
    if optimizer == "sgd":
        ob -= 4
    dense, expert = p.trained
    opt = dense * ob / (dp_cp if distributed_optimizer else 1) + expert * ob / (edp if distributed_optimizer else 1)
    return ModelStateMemory(
        params=p.total * pb, grads=(dense + expert) * gb, optimizer=opt, fp8_weights=p.linear * 1.0 if fp8 else 0.0
    )


def trainer_memory(p: StageParams, *, precision: str, optimizer: str, distributed_optimizer: bool, dp_cp: int,
                   edp: int, fp8: bool, reference: bool, activations: float,
                   critic: StageParams | None = None, teacher: StageParams | None = None) -> TrainerMemory:
    """One trainer GPU of a pipeline stage; `critic`: the critic's parameters on that rank (its
    weights, gradients and optimizer state are added; its activations are not, see above).
    `reference`: KL against a reference model, a copy of the parameters unless LoRA (the base);
    `teacher`: that reference is a model of its own (algorithm.reference_hf_dir), its parameters
    on that rank (LoRA or not: the base is not it)."""
    def state(params: StageParams) -> ModelStateMemory:
        return model_state_memory(params, precision=precision, optimizer=optimizer,
                                  distributed_optimizer=distributed_optimizer, dp_cp=dp_cp, edp=edp, fp8=fp8)

    w = state(p)
    return TrainerMemory(
        params=w.params,
        grads=w.grads,
        optimizer=w.optimizer,
        fp8_weights=w.fp8_weights,
        reference=(state(teacher).params if teacher is not None else w.params if not p.adapter else 0.0)
        if reference else 0.0,
        activations=activations,
        runtime=CUDA_RUNTIME_GIB * GIB,
        critic=state(critic) if critic is not None else None,
    )


def engine_lora_params(shape: ModelShape, *, rank: int, engine_tp: int) -> int:
    """Elements of the LoRA slots one engine TP rank allocates at --max-lora-rank `rank` (above)."""
    t = engine_tp

    def gated_mlp(ffn: int) -> int:  # gate, up (column-parallel) and down (row-parallel)
        return rank * (3 * shape.hidden + 3 * ffn // t) if ffn else 0

    per_slot = sum(shape.lora_layer_params(i, rank, LORA_TARGETS, tp=t) for i in range(shape.layers))
    per_slot += sum(shape.moe_layer) * (shape.experts * gated_mlp(shape.expert_ffn)
                                        + gated_mlp(shape.shared_expert_ffn))
    return ENGINE_LORA_SLOTS * per_slot


def vllm_batch_defaults(gpu_bytes: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM's OpenAI API server on a GPU of this much
    memory (vllm/engine/arg_utils.py `get_batch_defaults`): the profile run's forward pass and the
    sequences whose logits it materialises. vLLM gives an 80 GB A100 the small defaults; the
    planner, which knows only the memory, then estimates the larger activation peak (the safe side)."""
    if gpu_bytes >= 160 * GIB:
        return 16384, 1024
    if gpu_bytes >= 70 * GIB:
        return 8192, 1024
    return 2048, 256


def kv_bytes_per_token(shape: ModelShape, *, engine_tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes on one engine TP rank (K and V of every layer)."""
    kv_heads = max(1, math.ceil(shape.kv_heads / engine_tp))  # KV heads are replicated when tp > kv_heads
    return 2 * shape.layers * kv_heads * shape.head_dim * dtype_bytes


def engine_memory(shape: ModelShape, *, engine_tp: int, dtype_bytes: int, gpu_bytes: float, utilization: float,
                  max_model_len: int, enforce_eager: bool, lora_rank: int = 0) -> EngineMemory:
    """One engine TP rank; `lora_rank`: vLLM's --max-lora-rank (0 = --enable-lora off)."""
    t = engine_tp
    weights = shape.total_params() * dtype_bytes / t
    if shape.is_moe:
        ffn_tokens = shape.top_k * shape.expert_ffn + shape.shared_expert_ffn
    else:
        ffn_tokens = shape.ffn
    batched_tokens, max_seqs = vllm_batch_defaults(gpu_bytes)
    act = (
        batched_tokens
        * dtype_bytes
        * (2 * shape.hidden + (shape.q_width + 2 * shape.kv_width) / t + 3 * ffn_tokens / t)
    )
    act += max_seqs * shape.vocab * 4 / t
    runtime = (CUDA_RUNTIME_GIB + (0.0 if enforce_eager else CUDA_GRAPHS_GIB)) * GIB
    budget = utilization * gpu_bytes
    kv_per_token = kv_bytes_per_token(shape, engine_tp=t, dtype_bytes=dtype_bytes)
    lora = engine_lora_params(shape, rank=lora_rank, engine_tp=t) * dtype_bytes if lora_rank else 0.0
    return EngineMemory(budget, weights, act, runtime, budget - weights - lora - act - runtime, kv_per_token,
                        max_model_len, lora)


def largest_tensor_params(shape: ModelShape) -> int:
    """Elements of the largest full tensor a weight sync gathers: the embedding, unless a fused
    Megatron linear (fc1 = gate + up, or QKV) is larger."""
    fused = max(2 * shape.ffn, 2 * shape.expert_ffn, shape.q_width + 2 * shape.kv_width)  # fc1 = gate + up; QKV
    return max(shape.embedding_params(), shape.hidden * fused)


@dataclass(frozen=True)
class SyncBuffers:
    """GPU bytes the weight-sync transport holds during the sync phase (see the module docstring)."""

    sender: float = 0.0   # on a stage's sending trainer rank (tp 0, dp 0, cp 0)
    other: float = 0.0    # on the stage's other trainer ranks
    engine: float = 0.0   # on every engine rank


def sync_buffers(transport: str, *, bucket_bytes: float, largest: float, big_tensors: int,
                 stage_weights: float = 0.0, adapters_only: bool = False) -> SyncBuffers:
    """One pipeline stage's transport buffers. `largest`: bytes of the largest full tensor;
    `big_tensors`: how many tensors that large the engines receive (embedding, untied output
    layer); `stage_weights`: bytes of the stage's full weights (what cuda_ipc keeps exported)."""
    if adapters_only:
        return SyncBuffers()
    b, gather = bucket_bytes, 2 * largest
    sender = (stage_weights if transport == "cuda_ipc" else b) + gather
    engine = 4 * b + big_tensors * max(0.0, largest - b) if transport == "broadcast" else 0.0
    return SyncBuffers(sender, gather, engine)


@dataclass(frozen=True)
class Phase:
    """One phase of a colocated step on one GPU: bytes resident on the GPU and in host memory, by part."""

    name: str
    gpu: dict[str, float]
    host: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


@dataclass(frozen=True)
class ColocatedPhases:
    """The phases of one step on a GPU shared by a trainer rank and an engine rank, in step order."""

    rollout: Phase
    train: Phase
    sync: Phase

    def __iter__(self) -> Iterator[Phase]:
        return iter((self.rollout, self.train, self.sync))

    @property
    def peak(self) -> Phase:
        return max(self, key=lambda ph: ph.total)


def colocated_phases(trainer: TrainerMemory, engine: EngineMemory, *, offload_params: bool = False,
                     sleep_level: int = 1, sync: SyncBuffers | None = None, sender: bool = True) -> ColocatedPhases:
    """Bytes per phase on a GPU shared by a trainer rank and an engine rank (the module docstring's
    phase model); `sender`: this GPU's trainer rank is its stage's weight-sync sender."""
    e, t, buffers = engine, trainer, sync or SyncBuffers()
    engine_weights = {"engine weights": e.weights, "LoRA slots": e.lora}
    weights = t.weights()
    resident = {} if offload_params else weights
    optimizer = {"optimizer state": t.optimizer_state}
    rollout = Phase(
        "rollout",
        {**engine_weights, "engine activations": e.activations, "engine runtime": e.runtime, "KV": e.kv_cache,
         **resident, "fp8 cache": t.fp8_cache, "trainer runtime": t.runtime},
        {**optimizer, **(weights if offload_params else {})})
    train = Phase(
        "train",
        {"trainer params": t.params, "grads": t.grads, "optimizer": t.optimizer, "fp8 cache": t.fp8_weights,
         "reference": t.reference, "activations": t.activations, "critic": t.critic_bytes,
         "trainer runtime": t.runtime, "engine runtime": e.runtime},
        dict(engine_weights) if sleep_level == 1 else {})
    sync_phase = Phase(
        "sync",
        {**engine_weights, "engine runtime": e.runtime, **weights, "fp8 cache": t.fp8_cache,
         "trainer runtime": t.runtime,
         "transport buffers": (buffers.sender if sender else buffers.other) + buffers.engine},
        optimizer)
    return ColocatedPhases(rollout, train, sync_phase)
