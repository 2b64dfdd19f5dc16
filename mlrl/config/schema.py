"""The typed configuration tree: one dataclass per component, each field documented with its
unit and what "off" means. Components receive only their own sub-config.

Loading (YAML + `a.b=c` overrides) and type checking live in `loader.py`; cross-field checks
that need the model's HF config or the machine live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union

Dtype = Literal["float32", "bfloat16", "float16"]
Precision = Literal["fp32", "bf16", "fp16"]

PRECISION: dict[str, Precision] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""model.dtype -> the Megatron trainer's precision name (bf16 / fp16 train with fp32 master weights;
the name checkpoints record under optimizer.precision and the dry-run planner prints)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers LoRA can adapt, in peft's vocabulary (`all-linear` = all of them)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's linear layers (peft's LoRA: W x + (alpha / rank) B A x with
    A [rank, in], B [out, rank], B = 0 at the start). The base weights are frozen: only A and B are
    trained, checkpointed and (weight_sync.lora_mode=adapter) synced."""

    rank: int = 16
    """LoRA rank r (> 0)."""
    alpha: float = 32.0
    """LoRA alpha (> 0); the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1) (0 = off)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Adapted layers, peft names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
    `all-linear` (every one of them)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initialisation of A (B starts at zero): peft's default kaiming-uniform, or gaussian with std
    1 / rank (peft's init_lora_weights="gaussian")."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted layers with `all-linear` expanded, in LORA_TARGETS order."""
        wanted = set(self.target_modules)
        return LORA_TARGETS if "all-linear" in wanted else tuple(t for t in LORA_TARGETS if t in wanted)


@dataclass
class ModelConfig:
    hf_dir: str = "builtin:tiny-llama"
    """Hugging Face model folder (config.json + safetensors + tokenizer), or `builtin:<name>` for a
    model mlrl materialises offline (`builtin:tiny-llama`, `builtin:tiny-qwen3-moe`,
    `builtin:smollm2-135m-instruct`)."""
    dtype: Dtype = "float32"
    """Parameter / compute dtype of trainer and engines (vLLM --dtype; the trainer's precision
    follows it: float32 -> fp32, bfloat16 -> bf16, float16 -> fp16, see `precision`)."""
    arch: Optional[str] = None
    """Name of a known HF config (e.g. `Qwen/Qwen3-8B`, see mlrl.modelzoo) that --dry-run uses
    when hf_dir is not on this machine (None = read hf_dir/config.json). Where hf_dir is read (a
    real run), the preset must describe that model's shape, or validation refuses it."""
    lora: Optional[LoRAConfig] = None
    """LoRA fine-tuning of the policy (None = off: full fine-tuning). `model.lora.rank=16` turns it on."""
    init_from: Optional[str] = None
    """Start the trainer's weights from another run instead of hf_dir's: an mlrl checkpoint folder
    (`<run>/checkpoints/step_N`, e.g. of an SFT run: model weights only, no optimizer or loop
    state) or a Hugging Face folder (e.g. `<run>/hf/step_N`). hf_dir still names the architecture
    and tokenizer; the engines receive the weights at the initial sync. The KL reference starts from
    it too, and with model.lora it is the frozen base (the adapters start fresh; a LoRA run's
    checkpoint is refused: use its merged HF export). checkpoint.resume takes precedence for the
    policy: a resumed run takes its weights from its own checkpoint, and init_from then only gives
    the KL reference / LoRA base (so it must stay readable). None = hf_dir's weights."""

    bridge: Literal["auto", "builtin", "megatron-bridge"] = "auto"
    """HF <-> Megatron bridge (mlrl.bridge.select): `builtin` = mlrl's own (llama / mistral / qwen2 /
    qwen3 / qwen3_moe, RoPE default / linear / llama3 / yarn; `tools/convert_checkpoint.py --list`);
    `megatron-bridge` = NVIDIA megatron-bridge's AutoBridge for other architectures (GPU environment
    only: the `bridge` extra; not with model.lora, a critic or router replay); `auto` = builtin when
    it supports the model, else megatron-bridge when installed."""

    @property
    def precision(self) -> Precision:
        """The trainer's precision, derived from dtype (Megatron params dtype and bf16 / fp16 flags,
        with fp32 master weights for bf16 / fp16)."""
        return PRECISION[self.dtype]


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (1 = off)."""
    pp: int = 1
    """Pipeline-parallel size (1 = off)."""
    vpp: Optional[int] = None
    """Virtual pipeline chunks per stage (None = off; needs pp > 1)."""
    ep: int = 1
    """Expert-parallel size for MoE layers (1 = off)."""
    etp: Optional[int] = None
    """Tensor-parallel size inside experts (None = same as tp)."""
    cp: int = 1
    """Context-parallel size (1 = off; GPU only, needs Transformer Engine). The data-parallel size
    is not set: it is derived, cluster.trainer_devices / (tp * pp * cp) (Layout.dp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    pp_layer_split: Optional[list[int]] = None
    """Explicit number of layers per pipeline stage (None = even split)."""


@dataclass
class OptimizerConfig:
    """Learning rate schedule and regularisation of one model's optimizer: the policy's
    (`trainer.*`) and the critic's (`critic.*`) are the same fields, declared once here."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up (constant = no decay)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (0 = off)."""
    grad_clip: float = 1.0
    """Global grad-norm clip (0 = off)."""
    lr_warmup_steps: int = 0
    """Linear LR warm-up, in this model's optimizer updates (0 = off)."""


@dataclass
class TrainerConfig(OptimizerConfig):
    """The policy's Megatron trainer (lr / min_lr / lr_schedule / weight_decay / grad_clip /
    lr_warmup_steps: see
    OptimizerConfig). Its precision follows model.dtype (ModelConfig.precision)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (Megatron's get_megatron_optimizer); the critic uses the same kind."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    prompts_per_step: int = 8
    """Global batch, in prompts per RL step."""
    samples_per_prompt: int = 4
    """Responses sampled per prompt (the GRPO group size)."""
    mini_batches_per_step: int = 1
    """Optimizer updates per pass over the step's samples: the prompt groups of a step are split
    into this many mini-batches (whole groups; 1 = one update per pass)."""
    epochs_per_step: int = 1
    """Passes over the step's samples (PPO epochs); updates per RL step = mini_batches_per_step *
    epochs_per_step, and the LR schedule counts those updates."""
    micro_batch_tokens: Union[int, Literal["auto"]] = 4096
    """Token budget of one packed micro-batch (per DP rank). `auto`: sized to memory before any
    process starts (mlrl.plan.planner.auto_micro_batch_tokens, called by mlrl.launch right after
    validation). The floor is one whole sequence: prompt + new tokens, or rollout.max_model_len
    when longer (a multi-turn trajectory can be), an SFT sequence, a DPO pair. On GPU, the largest
    multiple of 256 tokens from the floor up to a DP rank's whole step (a pp-th of it with pp > 1,
    so every rank runs >= pp micro-batches) whose trainer-GPU estimate (mlrl.plan.memory: weights,
    gradients, optimizer state, activations; on a colocated GPU its training phase, the sleeping
    engine's share included) stays within AUTO_MEMORY_FRACTION of the GPU's memory
    (cluster.gpu_memory_gb, or the local GPUs' when smaller, read through NVML on a one-machine
    run). On CPU, where host memory is not planned, 4096 (the CPU default recipe's value) or the
    floor. The resolved number is what --print-config, --dry-run and the ranks see."""

    @property
    def token_budget(self) -> int:
        """micro_batch_tokens as a number (`auto` is resolved after validation: mlrl.launch)."""
        if isinstance(self.micro_batch_tokens, str):
            raise RuntimeError("trainer.micro_batch_tokens=auto is unresolved: mlrl.launch resolves it after "
                               "validate() (mlrl.plan.planner.resolve_micro_batch_tokens)")
        return self.micro_batch_tokens

    shared_prefix_packing: Literal["never", "always", "auto"] = "never"
    """Pack the samples of one prompt group around ONE copy of their common prompt: the prompt's
    tokens are run through the model once per group instead of once per sample, and every
    response attends to that shared copy (mlrl.experience.packing). Same logprobs, losses and
    gradients up to float rounding, fewer tokens (GRPO with group size G: the prompt part of the
    trainer's work shrinks G-fold). Needs the CPU trainer's local attention (not Transformer
    Engine on GPU) and no router replay: `always` is refused otherwise, `auto` packs shared prefixes
    exactly where they are supported (Config.uses_shared_prefix_packing)."""
    fp8_recipe: Literal["none", "tensorwise", "delayed", "blockwise", "mxfp8"] = "none"
    """Transformer Engine FP8 recipe (none = off; GPU only)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (none = off)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across DP ranks (Megatron DistributedOptimizer)."""
    total_steps: int = 10
    """RL steps to run."""
    seed: int = 1234
    """Seed of every RNG (model init, sampling order, dropout)."""
    startup_timeout_s: float = 300.0
    """Seconds for the trainer ranks to start: every rank connects to the driver, then (once it has
    the config; a colocated run's engines start and sleep first, not counted) builds its models
    (policy, KL reference, critic) and says hello. A big model read from a slow filesystem needs more."""
    deterministic: Union[bool, Literal["auto"]] = "auto"
    """Deterministic kernels and reductions (bit-exact reruns and resume). auto = on CPU (where
    it costs nothing), off on GPU; true on GPU costs speed and memory (TE's deterministic
    attention backward; README: GPU). false is refused on CPU (nothing to turn off there)."""

    @property
    def total_updates(self) -> int:
        """Optimizer updates of the whole run: total_steps * mini_batches_per_step * epochs_per_step
        (what the LR schedules of the policy and the critic count)."""
        return self.total_steps * self.mini_batches_per_step * self.epochs_per_step


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature (0 = greedy); the trainer applies the same temperature to its logprobs."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer divides its logits by: the sampling one, 1.0 for greedy (the
        engine's processed logprobs of a greedy request are those of the plain softmax)."""
        return self.temperature or 1.0

    top_p: float = 1.0
    """Nucleus sampling (1.0 = off). The engines report the logprobs of the distribution they
    sample from (vLLM's processed logprobs: after top-p / top-k, renormalised), the trainer those of
    the whole softmax: with top_p < 1 or top_k > 0 the train/rollout gap (train/mismatch/*) includes
    the truncation, and algorithm.rollout_is weighs against the truncated sampling policy."""
    top_k: int = -1
    """Top-k sampling (-1 = off); see top_p for the logprobs."""
    max_new_tokens: int = 64
    """Maximum response length in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (NeMo-RL's stop_strings): generation ends once the decoded response contains one
    (e.g. "</answer>"). The response keeps every token the engine generated, the one that completed
    the string included: those are the tokens trained on and the text the reward reads."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation besides the tokenizer's EOS (NeMo-RL's stop_token_ids, e.g. a
    chat template's end-of-turn token); the stop token is part of the response, as EOS is."""
    seed: Optional[int] = None
    """Reproducible sampling: every generation request gets its own vLLM seed, derived from this
    seed, the weight version, the group's start order at that version (evaluation apart), the
    episode index and the call number, so a run's
    samples do not depend on batching, engine choice or timing (None = off: the engines' shared
    RNG, whose draws depend on how requests were batched)."""


@dataclass
class RolloutConfig:
    num_engines: int = 1
    """vLLM servers in the pool."""
    engine_tp: int = 1
    """Tensor-parallel size of each engine."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_concurrent_requests: int = 64
    """Per-engine cap on in-flight requests."""
    staleness: int = 0
    """Async bound eta: a sample may be at most this many weight versions old (0 = synchronous)."""
    stale_policy: Literal["drop", "reweight"] = "drop"
    """What happens to a sample older than `staleness` versions: `drop` it, or `reweight`: keep it,
    weighted like any other sample by algorithm.rollout_is against its engine's logprobs."""
    interrupt_on_sync: bool = False
    """On a weight sync interrupt in-flight requests and resume them afterwards (False = let them finish first)."""
    host: str = "127.0.0.1"
    """Interface the engines' HTTP servers listen on (loopback by default)."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for an engine to become ready."""
    request_timeout_s: float = 600.0
    """Seconds before one generation request is failed."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may use (GPU only)."""
    cpu_kv_cache_gb: float = 1.0
    """KV-cache size in GiB on CPU engines (VLLM_CPU_KVCACHE_SPACE)."""
    max_model_len: Optional[int] = None
    """Engine context length (None = the model's)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / torch.compile (recommended on CPU)."""
    engine_log_stats: bool = False
    """vLLM's own statistics: its periodic throughput lines in the engine log and its Prometheus
    /metrics. Off by default (`--disable-log-stats`): mlrl reports rollout metrics itself, and
    vLLM's per-request stat bookkeeping held ~10% of the API server's py-spy samples during the
    CPU demo's rollouts."""


# weight_sync.canary_tolerance's default per model.dtype (see there)
CANARY_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


@dataclass
class WeightSyncConfig:
    transport: Literal["broadcast", "disk", "cuda_ipc"] = "broadcast"
    """How weights reach the engines: torch.distributed broadcast (gloo on CPU, NCCL on GPU),
    safetensors on disk, or CUDA IPC (colocated GPU only)."""
    bucket_mb: float = 64.0
    """Size of one broadcast bucket in MiB."""
    verify_checksums: bool = True
    """Compare checksums of what each engine received with what was sent."""
    canary_tolerance: Optional[float] = None
    """Max |trainer - engine| logprob on the canary prompt after a sync (<= 0 = off). None = by
    model.dtype (`CANARY_TOLERANCE`): 1e-3 in float32; 5e-2 in bfloat16 / float16, where the
    trainer's and the engine's kernels round differently (a random-weight Qwen3-1.7B shape, Megatron
    + Transformer Engine vs vLLM 0.26 on an H200: 0.0197 right after the first, exact, sync). The
    checksums verify every transfer bit for bit whatever this is."""
    def canary_tolerance_for(self, dtype: str) -> float:
        """canary_tolerance resolved for model.dtype `dtype`."""
        if self.canary_tolerance is not None:
            return self.canary_tolerance
        return CANARY_TOLERANCE.get(dtype, CANARY_TOLERANCE["bfloat16"])

    first_sync: Literal["auto", "push"] = "auto"
    """The run's first sync, before step 1. `push`: a full verified sync, like every step's. `auto`:
    when the engines loaded the trainer's own starting weights (a fresh run from model.hf_dir: no
    checkpoint to resume, no model.init_from, no model.lora), the canary alone compares the two and
    nothing is transferred (SmolLM2-135M's first sync: 2.2 s -> 0.3 s, tools/bench_startup.py); a
    full sync follows if it disagrees or the canary is off (canary_tolerance <= 0). Otherwise as
    `push`. The sync after each step is always full."""
    canary_every: int = 1
    """Run the canary on every Nth weight version (1 = every sync, the safe default). The first sync
    of a run, every refresh of a restarted engine and every retried attempt always run it; the
    checksums are verified on every sync regardless."""
    disk_dir: Optional[str] = None
    """Folder for the disk transport (None = <run dir>/weight_sync)."""
    lora_mode: Literal["merged", "adapter"] = "merged"
    """With model.lora: `merged` pushes the base weights with the adapters merged in (a copy; the
    trainer's base stays frozen) through the transport, for any engine; `adapter` pushes only the
    adapter (a PEFT folder under disk_dir) and the engines serve it through vLLM's LoRA support
    (started with --enable-lora; requests name the newest adapter version)."""


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False
    """Drop prompt groups whose task rewards (before overlong shaping) are all equal (no
    group-relative signal about the task) and generate more prompts until
    trainer.prompts_per_step informative groups are kept (False = off)."""
    max_rounds: int = 4
    """Generation rounds per step at most (sync: batches of the missing prompts; async: groups
    taken = max_rounds * prompts_per_step); then the step trains on what was kept."""


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator."""
    std_normalize: bool = True
    """GRPO: divide by the group std (False = mean-centering only); GAE: whiten the advantages over
    the step's policy tokens (False = raw GAE). Rejected with the other estimators, which never divide."""
    policy_loss: Literal["ppo", "dual_clip", "gspo"] = "ppo"
    """Policy-gradient loss."""
    eps_clip: float = 0.2
    """PPO clip epsilon (lower side)."""
    eps_clip_high: Optional[float] = None
    """Upper clip epsilon for DAPO clip-higher (None = same as eps_clip)."""
    dual_clip_c: float = 3.0
    """Dual-clip constant c (> 1)."""
    kl_coef: float = 0.0
    """KL penalty to the reference policy (0 = off, no reference model is built)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in_reward: bool = False
    """Put the KL into the reward instead of the loss."""
    reference_hf_dir: Optional[str] = None
    """The model the KL (kl_coef > 0) is measured against, a Hugging Face folder or builtin:<name>
    with the policy's vocabulary: a teacher (None = the policy's starting weights: model.hf_dir or
    model.init_from; with LoRA the base). Built on the trainer ranks in the policy's parallel layout,
    never trained or checkpointed. With kl_in_reward=true, kl_estimator=k1, advantage=reinforce_pp
    and gamma=0, each token's reward is minus kl_coef times the reverse KL to the teacher at that
    token: on-policy distillation (README: algorithms)."""
    entropy_coef: float = 0.0
    """Entropy bonus (0 = off)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How token losses are aggregated."""
    use_rollout_logprobs: bool = False
    """Take the behaviour ("old") logprobs of the PPO ratio from the engines instead of a trainer
    forward before the first update (False = trainer forward when more than one update per step,
    none at all with one update: old = current logprobs, detached)."""
    rollout_is: Literal["none", "tis", "mis_token", "mis_seq", "icepop"] = "none"
    """Train/rollout mismatch correction (none = off; required when staleness > 0)."""
    rollout_is_cap: float = 2.0
    """Cap of the importance ratio: TIS truncates at cap; MIS masks ratios outside [1/cap, cap]."""
    icepop_low: float = 0.5
    """ICEPOP (rollout_is=icepop): tokens whose train/rollout probability ratio is below this are masked out."""
    icepop_high: float = 5.0
    """ICEPOP (rollout_is=icepop): tokens whose train/rollout probability ratio is above this are masked out."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling: drop groups whose rewards (the workflow's scores, before overlong
    shaping) are all equal and refill the batch."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: tokens before max_new_tokens where the penalty starts (0 = off); a
    sample is measured by its longest generation (a multi-turn sample by its longest turn)."""
    overlong_penalty: float = 1.0
    """Maximum overlong penalty."""
    gamma: float = 1.0
    """Discount (GAE / REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    router_replay: bool = False
    """MoE router replay (R3): the engines record the experts every token was routed to, and the
    trainer's routers use exactly those (gates recomputed from the trainer's own router logits, so
    the router still learns) in every training forward and in the old / reference logprob passes.
    Per step, a diagnostic forward without replay reports `mismatch/router_agreement` and the
    train/rollout logprob gap with and without replay. MoE models only."""


@dataclass
class CriticConfig(OptimizerConfig):
    """The value model for PPO + GAE (algorithm.advantage=gae): the policy's architecture with a
    scalar value head, on the trainer ranks (same parallel layout), with its own optimizer
    (lr / min_lr / lr_schedule / weight_decay / grad_clip / lr_warmup_steps: see OptimizerConfig; the optimizer kind,
    betas, eps and the distributed optimizer are trainer's, the precision model.dtype's)."""

    hf_dir: Optional[str] = None
    """Initial weights of the critic's body (None = model.hf_dir, the policy's initial model); the
    value head starts at zero, or, when this is a one-label *ForSequenceClassification (a reward
    model, e.g. an rm run's export), at its score head: initial values are its scores."""
    value_clip: float = 0.2
    """PPO value clipping: V is kept within +-value_clip of the values before the update (0 = off)."""
    critic_only_steps: int = 0
    """First RL steps that update only the critic (the policy is not updated; 0 = off). Not an LR
    warm-up: that is critic.lr_warmup_steps."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning instead of RL (`python -m mlrl.launch` with an `sft:` section): the
    same Megatron policy, trainer ranks and checkpoints; chat rows from data.train (held-out loss on
    data.eval, every data.eval_every steps), loss on assistant tokens only (token mean over the
    step). Uses model, parallel, trainer (optimizer and schedule fields, micro_batch_tokens,
    total_steps = optimizer steps, seed), data (not data.max_prompt_tokens: sft.max_seq_tokens cuts),
    checkpoint, logging and cluster; the RL sections
    (rollout, weight_sync, algorithm, critic, workflow, eval) and trainer.prompts_per_step /
    samples_per_prompt / mini_batches_per_step / epochs_per_step must keep their defaults."""

    batch_size: int = 32
    """Conversations per optimizer step (split over the data-parallel ranks, packed into
    micro-batches of trainer.micro_batch_tokens)."""
    max_seq_tokens: int = 1024
    """Conversations longer than this many tokens are cut (counted in the run's start-up log line,
    training and held-out data)."""


@dataclass
class DPOConfig:
    """Direct preference optimisation instead of RL (`python -m mlrl.launch` with a `dpo:` section):
    offline preference pairs (data.train, held out: data.eval) train the Megatron policy against a
    frozen copy of its initial weights (the reference; with LoRA: the base, adapters off). Uses the
    same sections as an SFT run (see SFTConfig); the RL sections must keep their defaults."""

    batch_size: int = 32
    """Preference pairs per optimizer step (split over the data-parallel ranks; each pair's chosen
    and rejected sequences are packed into the same micro-batch of trainer.micro_batch_tokens)."""
    max_seq_tokens: int = 1024
    """Chosen / rejected sequences (prompt + completion) longer than this are cut (counted in the
    run's start-up log line, training and held-out data)."""
    beta: float = 0.1
    """Strength of the implicit KL constraint: sigmoid loss -log sigmoid(beta * h); IPO's target
    margin is 1 / (2 beta). Larger beta: the policy stays closer to the reference."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO, Rafailov et al. 2023) | ipo (IPO, Azar et al. 2023, on per-token mean
    log-probabilities as in TRL)."""


@dataclass
class RMConfig:
    """Reward-model training instead of RL (`python -m mlrl.launch` with an `rm:` section): the
    Bradley-Terry pairwise loss (Ouyang et al. 2022; TRL's RewardTrainer) on the same offline
    preference pairs a DPO run reads (data.train, held out: data.eval). The model is the policy's
    architecture with a new scalar head (drawn as transformers draws a classifier's) in place of the
    LM head, on the trainer ranks; a sequence's score is the head's output at its last token.
    Exports a Hugging Face `*ForSequenceClassification` folder (one label) that
    `reward_model: {kind: classifier}` serves to an RL run. Uses the same sections as an SFT run
    (see SFTConfig); the RL sections must keep their defaults."""

    batch_size: int = 32
    """Preference pairs per optimizer step (split over the data-parallel ranks; each pair's chosen
    and rejected sequences are packed into the same micro-batch of trainer.micro_batch_tokens)."""
    max_seq_tokens: int = 1024
    """Chosen / rejected sequences (prompt + completion) longer than this are cut (counted in the
    run's start-up log line, training and held-out data)."""
    center_rewards_coefficient: float = 0.0
    """Adds coef * mean over pairs of (r_chosen + r_rejected)^2 to the loss (Eisenstein et al. 2023,
    TRL's `center_rewards_coefficient`): pulls the scores toward mean 0, which the pairwise loss
    alone leaves free (0 = off)."""


OFFLINE_KINDS = ("sft", "dpo", "rm")  # the sections of a run of the trainer alone (Config.offline)


@dataclass
class EvalConfig:
    samples_per_prompt: int = 1
    """Responses sampled per held-out prompt (k of pass@k)."""
    correct_threshold: float = 1.0
    """A response counts as correct for pass@k when its reward is >= this."""
    save_answers: bool = False
    """Write every answer of each held-out evaluation of a training run to
    `<run_dir>/eval/step_N.jsonl` (the evaluation job's answer records: prompt, response, reward,
    correct, ...). An evaluation run (evaluate:) always writes them, to evaluate.output."""
    at_start: bool = False
    """Also evaluate the starting policy once before step 1, logged as step 0 (verl's
    val_before_train, NeMo-RL's val_at_start): the baseline the eval/* curves start from. A fresh
    run only: a resumed run evaluated its start already."""


@dataclass
class EvaluateConfig:
    """An evaluation run: the engines alone answer data.eval (no trainer, no training). Each
    prompt is answered eval.samples_per_prompt times through the workflow and scored by its reward
    (or the reward_model judge); pass@1, pass@k and the mean reward go to `<run_dir>/eval_metrics.json`
    (and metrics.jsonl / TensorBoard / W&B), every answer to `output`. The model is model.hf_dir:
    a Hugging Face folder, e.g. a run's export `<run>/hf/step_N` (tools/convert_checkpoint.py
    converts a training checkpoint)."""

    output: Optional[str] = None
    """The answers, one JSON line each (prompt index, sample, prompt, response, reward, correct,
    status, error): None = `<logging.run_dir>/eval_samples.jsonl`. Written as the groups finish."""
    max_prompts: int = 0
    """Evaluate the first N prompts of data.eval (of each source, with data.mix; 0 = all)."""


@dataclass
class DataSource:
    """One source of a prompt mixture (`data.mix`). Its rows carry `data_source: <name>` (a row's
    own data_source is replaced), which picks the source's reward and names its metrics
    (`source/<name>/...` in training, `eval/source/<name>/...` held out)."""

    name: str = ""
    """The source's label (letters, digits, `_`, `-`, `.`; unique in the mix)."""
    train: str = ""
    """Its training prompts: anything data.train accepts. Empty in an RL run = a held-out source
    (eval only: evaluated every data.eval_every steps, never trained on, no weight)."""
    eval: Optional[str] = None
    """Its held-out prompts: anything data.eval accepts (None = none from this source)."""
    weight: Optional[float] = None
    """Its share of each epoch's prompts: a source gets round(weight / sum of weights x the mix's rows)
    of them (at least 1), its rows cycled in seeded orders (a small source repeats, a large one is
    read on over epochs). None on every source = each source's rows once per epoch. Set on every
    source with train prompts or on none."""
    reward: Optional[str] = None
    """The reward for its rows (a registered name or dotted path); None = the dataset's own (a
    synthetic task's or a registered loader's), else workflow.reward."""


@dataclass
class DataConfig:
    train: str = "synthetic:copy_digit"
    """Training dataset: a registered name, `synthetic:<task>`, a .jsonl / .json / .parquet file, a
    folder (`<split>.jsonl`, a Hub download's parquet shards, a `datasets` save) or a
    `pkg.module:loader` function."""
    eval: Optional[str] = None
    """Held-out dataset (None = off)."""
    eval_every: int = 0
    """Evaluate every k steps (0 = off)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are rejected."""
    shuffle: bool = True
    """Shuffle every epoch (seeded)."""
    skip_malformed: bool = False
    """Skip and count malformed rows instead of failing."""
    num_synthetic: int = 512
    """Rows generated for a synthetic task."""
    mix: list[DataSource] = field(default_factory=list)
    """A mixture of prompt sources (RL and evaluation runs), instead of data.train / data.eval: each
    with its own data, share of the prompts, reward and held-out set (see DataSource); the
    rollout and evaluation metrics are also reported per source."""

    def held_out(self) -> bool:
        """Whether held-out prompts are configured (data.eval, or a source's eval in data.mix)."""
        return self.eval is not None or any(s.eval for s in self.mix)

    def describe(self, which: str) -> str:
        """data.<which>'s name, or the mix's sources as `name=data` (for messages and files)."""
        if not self.mix:
            return str(getattr(self, which))
        return "mix(" + ", ".join(f"{s.name}={getattr(s, which)}" for s in self.mix if getattr(s, which)) + ")"


JUDGE_TEMPLATE = ("Rate the answer to the question from 0 to 10.\nQuestion: {question}\nReference answer: {answer}\n"
                  "Answer: {response}\nReply with 'Score: <0-10>'.")


@dataclass
class RewardModelConfig:
    """A reward model served in the pool beside the policy's engines (`reward_model:`; None = none):
    its own vLLM engines, never synced, scored through `workflow.reward=reward_model`.
    kind=generative: an LLM judge. Each (prompt, response) is rendered into `prompt_template`
    (placeholders {question}, {response}, {answer}) as one user turn of the judge's chat template,
    the judge answers greedily in at most `max_tokens` tokens, and the LAST match of
    `score_pattern` (its first group; a judge that reasons first names other numbers before its
    verdict) divided by `max_score` is the reward; a reply without a match, or a score outside
    [0, max_score], scores 0 and counts as a reward failure of that episode."""

    hf_dir: str = ""
    """The judge's Hugging Face folder (or builtin:<name>)."""
    kind: str = "generative"
    """generative: an LLM judge (the fields below). classifier: an HF *ForSequenceClassification
    reward model on vLLM engines with --runner pooling; the reward is the probability of its last
    label for the conversation (question as the user turn, response as the assistant turn) in the
    reward model's chat template (one label: the sigmoid of its score); the template / pattern /
    max_score / max_tokens fields are generative-only."""
    num_engines: int = 1
    engine_tp: int = 1
    prompt_template: str = JUDGE_TEMPLATE
    score_pattern: str = r"(?i)score\s*[:=]?\s*([-+]?\d+(?:\.\d+)?)"
    max_score: float = 10.0
    """The parsed score is divided by this (rewards in [0, 1] for a 0-10 judge)."""
    max_tokens: int = 16
    """The judge's reply budget (greedy)."""
    cpu_kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    max_model_len: Optional[int] = None

    def engines(self, rollout: RolloutConfig) -> RolloutConfig:
        """The judge's engine-pool settings: the rollout's, with this section's engine fields."""
        return replace(rollout, num_engines=self.num_engines, engine_tp=self.engine_tp,
                                   cpu_kv_cache_gb=self.cpu_kv_cache_gb, max_model_len=self.max_model_len,
                                   gpu_memory_utilization=self.gpu_memory_utilization)


@dataclass
class WorkflowConfig:
    name: str = "rlvr"
    """Registered workflow name or dotted path `pkg.module.Class`."""
    reward: str = "exact_match"
    """Registered reward function name or dotted path."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra constructor arguments of the workflow."""
    max_concurrency: int = 64
    """Episodes in flight at once."""
    episode_timeout_s: float = 300.0
    """Seconds before an episode is recorded as TIMEOUT (0 = off)."""
    reward_timeout_s: float = 30.0
    """Seconds before a reward call gives 0.0."""
    reward_workers: int = 2
    """Reward process-pool size."""
    max_failure_fraction: float = 0.5
    """A training step whose share of failed episodes (error or timeout) exceeds this, for
    `max_failure_steps` steps in a row, stops the run (exit 1, the first failure's traceback on
    stderr). A step in which every episode failed always stops it: nothing is trained on nothing
    (an episode none of whose reward calls gave a score counts as failed there)."""
    max_failure_steps: int = 3
    """Consecutive steps above `max_failure_fraction` that stop the run."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint root (None = <run dir>/checkpoints)."""
    save_every: int = 0
    """Save every k steps (0 = only at the end)."""
    save_at_end: bool = True
    """Save after the last step."""
    keep_last: int = 2
    """Keep this many complete checkpoints (0 = keep all)."""
    resume: str = "auto"
    """`auto` (latest complete one if any), `none`, or a checkpoint path."""
    hf_export_every: int = 0
    """Export a Hugging Face model every k steps (0 = off)."""
    hf_export_at_end: bool = True
    """Export a Hugging Face model after the last step."""
    export_merged: bool = True
    """With model.lora: an HF export writes the merged model (W + alpha/r B A) besides the PEFT
    adapter folder (<export>/adapter); false = the adapter folder only."""
    async_save: bool = False
    """Asynchronous save (GPU only)."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Run folder: metrics, plots, checkpoints by default."""
    jsonl: bool = True
    """Write metrics.jsonl."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb_project: Optional[str] = None
    """Weights & Biases project (None = off)."""
    progress_bar: bool = True
    """Show a progress bar."""
    plot: bool = True
    """Write a PNG of reward / KL / logprob gap / step time at the end."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


@dataclass
class ColocateConfig:
    """How trainer and engines time-share devices under cluster.placement=colocated."""

    sleep_level: int = 1
    """vLLM sleep level while the trainer steps: 1 keeps the engines' weights in host memory and
    discards the KV cache; 2 discards both (the weight sync overwrites the weights anyway; not with
    weight_sync.lora_mode=adapter, whose syncs send only the adapters). GPU only: vLLM's CPU worker
    keeps its memory whatever the level, so a CPU run accepts only 1."""
    offload_params: bool = False
    """Also move the trainer's parameters to host memory while the engines generate (optimizer
    state and gradients always move out). Costs a host<->device copy of the weights per step."""


@dataclass
class ClusterConfig:
    nodes: int = 1
    """Machines (1 = local; > 1 = a Ray cluster)."""
    gpus_per_node: int = 0
    """GPUs per node (0 = CPU: trainer processes and engines share the cores)."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """Trainer and engines on separate GPUs, or time-sharing the same GPUs: colocated, the engines
    sleep (vLLM sleep mode) while the trainer steps and the trainer offloads its optimizer state and
    gradients to host memory while the engines generate (cluster.colocate)."""
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    """Sleep level and offload set of placement=colocated."""
    trainer_devices: Optional[int] = None
    """Trainer ranks, the one place their number is set (None = all GPUs when colocated, the GPUs
    left after the engines when disaggregated; on CPU, tp*pp*cp, i.e. dp = 1). The data-parallel
    size is derived: trainer_devices / (parallel.tp * pp * cp), and tp*pp*cp must divide it."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU in GiB (--dry-run's fit check, and what trainer.micro_batch_tokens=auto sizes
    the micro-batches to)."""
    ray_address: str = "auto"
    """Ray cluster address for --nodes > 1."""
    join_timeout_s: float = 600.0
    """--nodes > 1: how long to wait for the nodes to join the Ray cluster (and, again, for the
    GPU reservation) before failing with what did register."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: Optional[CriticConfig] = None
    """The value model: needed by algorithm.advantage=gae (an error without it); with the other
    estimators, which use no values, no critic is built and the section is not used (recipes may
    carry it for gae runs). None = no critic section."""
    sft: Optional[SFTConfig] = None
    """Supervised fine-tuning run (None = an RL run): see SFTConfig."""
    dpo: Optional[DPOConfig] = None
    """Preference optimisation run, DPO / IPO (None = an RL run): see DPOConfig."""
    rm: Optional[RMConfig] = None
    """Reward-model training run, Bradley-Terry on preference pairs (None = an RL run): see RMConfig."""
    evaluate: Optional[EvaluateConfig] = None
    """Evaluation run, the engines alone on data.eval (None = a training run): see EvaluateConfig."""
    reward_model: Optional[RewardModelConfig] = None
    """A judge served on its own engines (workflow.reward=reward_model): see RewardModelConfig."""
    data: DataConfig = field(default_factory=DataConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    @property
    def asynchronous(self) -> bool:
        """Asynchronous training (generation overlaps training) is on exactly when
        rollout.staleness > 0; with 0 the run is synchronous and on-policy."""
        return self.rollout.staleness > 0

    @property
    def offline(self) -> Optional[str]:
        """"sft", "dpo" or "rm" for a run of the trainer alone on a fixed dataset (no engines, no
        rollout); None for an RL run."""
        return next((name for name in OFFLINE_KINDS if getattr(self, name) is not None), None)

    @property
    def offline_section(self) -> "Optional[SFTConfig | DPOConfig | RMConfig]":
        """The section of the offline run (`offline`), None for an RL run."""
        return getattr(self, self.offline) if self.offline else None

    @property
    def trains_on_pairs(self) -> bool:
        """A DPO or reward-model run: its samples are (chosen, rejected) pairs, each pair whole in one
        micro-batch."""
        return self.dpo is not None or self.rm is not None

    @property
    def uses_shared_prefix_packing(self) -> bool:
        """trainer.shared_prefix_packing resolved: always, or auto in an RL run on a CPU trainer without
        router replay."""
        mode = self.trainer.shared_prefix_packing
        return mode == "always" or (mode == "auto" and self.offline is None and self.cluster.gpus_per_node == 0
                                and not self.algorithm.router_replay)

    @property
    def policy_updates(self) -> int:
        """The policy's optimizer updates of the run, which its LR schedule decays over:
        trainer.total_updates less those of the critic-only steps (critic.critic_only_steps, which
        train only the critic)."""
        t = self.trainer
        skip = self.critic.critic_only_steps if self.uses_critic and self.critic is not None else 0
        return max(0, t.total_steps - skip) * t.mini_batches_per_step * t.epochs_per_step

    @property
    def uses_critic(self) -> bool:
        """A critic is built and trained: the estimator needs values (gae) and the section exists."""
        return self.algorithm.advantage == "gae" and self.critic is not None
