"""Tokens/s of mlrl's Megatron train step vs a Hugging Face transformers train step, same model,
same batch, measured side by side in one run; prints the ratio.

    python tools/bench_train_step.py --hf-dir builtin:smollm2-135m-instruct [--tp N] [--pp N] \
        [--samples 16] [--sample-len 128] [--micro-batches 2] [--steps 3]
    python tools/bench_train_step.py --device cuda --model-shape qwen3-1.7b [--seq 2048] \
        [--samples 16] [--micro-batches 4 | --micro-batch-tokens N|auto] [--recompute none|selective|full] \
        [--fp8-recipe tensorwise|delayed|blockwise|mxfp8] [--steps 5] [--warmup 2] [--peak-tflops 989] [--json PATH]

Both sides do the full step: forward, token logprobs + entropy, a policy-gradient loss
normalised over the step, backward, grad clipping, AdamW. Megatron runs the packed
micro-batches through `MegatronPolicy.update` (tp*pp processes, launched here with
torchrun), then times the forward-only pass of the reference / old policy
(`compute_logprobs`); HF runs on rank 0 afterwards with the samples of each micro-batch as one
unpadded batch (all samples have the same length, so neither side wastes work on padding). The
first `--warmup` steps of each side are not timed.

`--device cpu` (default): float32, gloo; HF gets as many threads as the Megatron ranks had
together; the last line is `ratio megatron_over_hf: x`.

`--device cuda`: one process per GPU (tp*pp), model.dtype=bfloat16 (Megatron: bf16 params with
fp32 master weights in its optimizer, Transformer Engine layer spec); HF: bf16 params, SDPA
attention, fused torch AdamW (its states in bf16, no fp32 master copy: HF needs less memory for
the same model). Each side reports tok/s, MFU and peak memory (`torch.cuda.max_memory_allocated` /
`max_memory_reserved`, reset between the sides; mlrl: the maximum over its ranks); the last line
is `ratio mlrl_over_hf: x` (mlrl train tok/s over HF train tok/s).

`--micro-batch-tokens N|auto` splits the samples as `trainer.micro_batch_tokens` would (whole
samples, at most N tokens per micro-batch); `auto` asks mlrl's planner
(`mlrl.plan.planner.auto_micro_batch_tokens`) for this GPU's memory, as `mlrl.launch` does, and
on cuda the output sets the planner's estimate of the training phase beside the measured peak.
`--fp8-recipe R` (cuda) times a second mlrl side with `trainer.fp8_recipe=R` after the bf16 one,
same batch; the last line is then `ratio fp8_over_bf16: x` (bf16 step time over FP8's).
`--mlrl-only` (cuda) skips the HF side, e.g. for a micro-batch its full-vocabulary fp32 logits
could not hold; the last line is then `ratio peak_over_planned: x`.

`--model-shape NAME` writes a random-weight HF folder (bf16 safetensors) of a public model's
shape into a temp dir once, before torchrun, and deletes it at the end: no download. `tiny` is
a small Llama for tests.

MFU (dense decoders: the --model-shape shapes; an MoE --hf-dir would be over-counted), the
PaLM paper's appendix-B accounting with its attention term halved for the causal mask:

    MFU = (6 * P * tok/s + A * tok/s) / (peak_tflops * 1e12 * gpus)
    P = matmul parameters: every Linear weight of the layers (q, k, v, o, gate, up, down) plus the
        lm_head, counted once when tied to the embedding; not the embedding lookup, not norms
    A = training attention FLOPs per token = 6 * layers * 2 * heads * head_dim * seq_len / 2
        (QK^T and AV, 2 FLOPs per multiply-add, fwd + bwd = 3x, causal: half of the square)

The forward-only MFU uses 2 * P and A / 3. `gpus` is tp*pp for mlrl and 1 for HF.
`--peak-tflops` defaults to 989, the H100 / H200 SXM bf16 dense peak; the output names the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HF_DIR_ENV = "MLRL_BENCH_HF_DIR"  # the launcher's random folder, handed to the torchrun workers

# Public model shapes (config values of the released config.json files, weights random).
_LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES: dict[str, tuple[str, dict]] = {
    "tiny": ("llama", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, vocab_size=256, tie_word_embeddings=True,
                           max_position_embeddings=131072, rms_norm_eps=1e-6, rope_parameters=dict(_LLAMA32_ROPE))),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                  num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                                  tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                  bos_token_id=128000, eos_token_id=128001, rope_parameters=dict(_LLAMA32_ROPE))),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                                 tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                 max_window_layers=28, bos_token_id=151643, eos_token_id=151645,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                               tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                               max_window_layers=36, bos_token_id=151643, eos_token_id=151645,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
# per-device defaults of the flags that default to None
_DEFAULTS = {"cpu": dict(sample_len=128, micro_batches=2, steps=3, warmup=1),
             "cuda": dict(sample_len=2048, micro_batches=4, steps=5, warmup=2)}


# ---- model shapes and FLOPs (pure; tests/unit/trainer/test_bench_train_step.py) -------------------
def shape_config(name: str):
    """The transformers config (LlamaConfig / Qwen3Config) of shape `name`, bf16."""
    from transformers import LlamaConfig, Qwen3Config

    model_type, fields = SHAPES[name]
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    return cls(**fields, dtype="bfloat16")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def matmul_params(cfg) -> int:
    """P of the MFU formula for a dense decoder config: q/k/v/o and gate/up/down weights of every
    layer plus the lm_head (once, tied or not). Biases, norms and the embedding lookup excluded."""
    h, heads, hd = cfg.hidden_size, cfg.num_attention_heads, _head_dim(cfg)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * h


def train_flops_per_token(cfg, seq_len: int) -> float:
    """6 * P + A (module docstring): FLOPs of one trained token in a sequence of seq_len tokens."""
    attn = 6 * cfg.num_hidden_layers * 2 * cfg.num_attention_heads * _head_dim(cfg) * seq_len / 2
    return 6 * matmul_params(cfg) + attn


def forward_flops_per_token(cfg, seq_len: int) -> float:
    """2 * P + A / 3: the forward pass alone is a third of the training FLOPs."""
    return train_flops_per_token(cfg, seq_len) / 3


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over the peak of `gpus` devices."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * gpus)


def write_random_hf_dir(name: str, out: Path, *, block: int = 1 << 20) -> Path:
    """A Hugging Face folder (config.json + bf16 safetensors) of shape `name` with random weights.
    The model is built on the meta device (no init pass), given uninitialised CPU storage, and
    filled by copying one N(0, 0.02) block over every matrix (norm weights = 1): memory-bandwidth
    bound, seconds even for 8B parameters, where a per-tensor randn would take minutes on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = shape_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    g = torch.Generator().manual_seed(0)
    noise = (torch.randn(block, generator=g) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for p in {id(t): t for t in model.state_dict().values()}.values():
            if p.dim() < 2:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for i in range(0, flat.numel(), block):
                chunk = flat[i:i + block]
                chunk.copy_(noise[: chunk.numel()])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def bench_config(args, hf_dir: Path, *, fp8_recipe: str | None = None):
    """The Config the mlrl side trains with; as an SFT section (a fixed batch of --samples
    sequences of --sample-len tokens, the trainer alone, no reference model) it is also what
    mlrl's planner sizes micro-batches and memory for."""
    from mlrl.config.schema import Config, SFTConfig

    cfg = Config()
    cfg.model.hf_dir = str(hf_dir)
    if args.device == "cuda":
        cfg.model.dtype = "bfloat16"
        cfg.cluster.gpus_per_node = args.tp * args.pp
    cfg.parallel.tp, cfg.parallel.pp = args.tp, args.pp
    cfg.trainer.lr, cfg.trainer.grad_clip = 1e-6, 1.0
    cfg.trainer.total_steps = args.steps + args.warmup
    cfg.trainer.recompute = args.recompute
    if fp8_recipe is not None:
        cfg.trainer.fp8_recipe = fp8_recipe
    cfg.sft = SFTConfig(batch_size=args.samples, max_seq_tokens=args.sample_len)
    return cfg


def samples_per_micro_batch(samples: int, sample_len: int, *, budget: int | None = None,
                            micro_batches: int | None = None) -> int:
    """Whole samples per micro-batch: as many as a token budget holds (trainer.micro_batch_tokens'
    first-fit packing of equal samples: full micro-batches, the last one partial), or an even
    split into --micro-batches (torch.chunk's sizes)."""
    if budget is not None:
        return max(1, min(samples, budget // sample_len))
    assert micro_batches is not None
    return -(-samples // micro_batches)


FP8_MIN_CAPABILITY = {"tensorwise": (8, 9), "delayed": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def resolve_micro_batches(args, hf_dir: Path, device_gb: float | None) -> dict:
    """--micro-batches K or --micro-batch-tokens N|auto -> args.per_micro_batch and
    args.micro_batches (set in place), and what the planner expects of the largest micro-batch:
    {"micro_batch_tokens" (the budget), "micro_batch_tokens_auto", "largest_micro_batch_tokens",
    "planned_train_gb"} (GB of the fullest GPU's training phase in bf16, against torch's peak
    allocated; None on cpu, where host memory is not planned, or for a model the planner cannot
    shape). auto uses mlrl.plan's auto_micro_batch_tokens with `device_gb` (this GPU's memory,
    GiB) as the GPU's size, as `mlrl.launch` does on one machine."""
    from mlrl.config.validate import resolve_layout
    from mlrl.plan.planner import auto_micro_batch_tokens, make_plan, trainer_train_bytes

    cfg = bench_config(args, hf_dir)  # bf16: the side the planner's estimate is compared with
    layout = resolve_layout(cfg)
    if device_gb is not None:
        cfg.cluster.gpu_memory_gb = device_gb
    n, L = args.samples, args.sample_len
    if args.micro_batch_tokens is None:
        per = samples_per_micro_batch(n, L, micro_batches=args.micro_batches)
        budget = per * L
    else:
        budget = auto_micro_batch_tokens(cfg, layout, device_gb) if args.micro_batch_tokens == "auto" \
            else int(args.micro_batch_tokens)
        per = samples_per_micro_batch(n, L, budget=budget)
    args.per_micro_batch, args.micro_batches = per, -(-n // per)
    cfg.trainer.micro_batch_tokens = per * L  # the largest micro-batch the bench runs
    planned = None
    if cfg.cluster.gpus_per_node:
        try:
            planned = trainer_train_bytes(make_plan(cfg, layout)) / 1e9
        except Exception as e:  # a model outside the planner's shapes: bench without an estimate
            print(f"bench_train_step: no memory estimate for this model ({type(e).__name__}: {e})", flush=True)
    return {"micro_batch_tokens": budget, "micro_batch_tokens_auto": args.micro_batch_tokens == "auto",
            "largest_micro_batch_tokens": per * L, "planned_train_gb": planned}


# ---- arguments and launch ---------------------------------------------------------------------------
def _tokens_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}")
    return value


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", default="builtin:smollm2-135m-instruct", help="an HF folder or builtin:<name>")
    src.add_argument("--model-shape", choices=sorted(SHAPES), default=None,
                     help="a random-weight folder of this public shape, written to a temp dir (no download)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16, help="samples per step")
    ap.add_argument("--sample-len", "--seq", dest="sample_len", type=int, default=None,
                    help="tokens per sample (default: 128 on cpu, 2048 on cuda)")
    split = ap.add_mutually_exclusive_group()
    split.add_argument("--micro-batches", type=int, default=None, help="default: 2 on cpu, 4 on cuda")
    split.add_argument("--micro-batch-tokens", type=_tokens_or_auto, default=None, metavar="N|auto",
                       help="size the micro-batches as trainer.micro_batch_tokens does (whole samples of at most N "
                            "tokens each); auto: mlrl's planner for this GPU's memory (4096 on cpu)")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                    help="trainer.recompute of the mlrl side")
    ap.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "blockwise", "mxfp8"], default=None,
                    help="cuda: also time an FP8 mlrl side (trainer.fp8_recipe) after the bf16 one; the last "
                         "line is then `ratio fp8_over_bf16`")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (default: 3 on cpu, 5 on cuda)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default: 1 on cpu, 2 on cuda)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="per-GPU bf16 dense peak for MFU (default 989: H100 / H200 SXM)")
    ap.add_argument("--mlrl-only", action="store_true",
                    help="cuda: no HF side (e.g. a micro-batch HF cannot hold); the last line is then "
                         "`ratio peak_over_planned` (measured peak allocated over the planner's estimate)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.samples < 1:
        ap.error(f"--samples: expected a positive integer, got {args.samples}")
    for key, value in _DEFAULTS[args.device].items():
        if key == "micro_batches":
            if args.micro_batch_tokens is not None:
                continue  # the worker derives it from the token budget
            value = min(value, args.samples)
        if getattr(args, key) is None:
            setattr(args, key, value)
    if isinstance(args.micro_batch_tokens, int) and args.micro_batch_tokens < args.sample_len:
        ap.error(f"--micro-batch-tokens {args.micro_batch_tokens}: a micro-batch holds whole samples, at least "
                 f"--sample-len ({args.sample_len}) tokens")
    if args.micro_batches is not None and not 1 <= args.micro_batches <= args.samples:
        ap.error(f"--micro-batches: expected 1..--samples ({args.samples}), got {args.micro_batches}")
    if args.mlrl_only and args.device != "cuda":
        ap.error("--mlrl-only: the planner's estimate it reports is for GPUs; add --device cuda")
    if args.fp8_recipe is not None and args.device != "cuda":
        ap.error(f"--fp8-recipe {args.fp8_recipe}: FP8 runs through Transformer Engine on a GPU; add --device cuda")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch.cuda.is_available() is False on this machine (no GPU visible, or a "
                     "CPU build of torch); run on a GPU machine or leave --device at cpu")
        if torch.cuda.device_count() < args.tp * args.pp:
            ap.error(f"--device cuda: --tp * --pp = {args.tp * args.pp} processes need as many GPUs, "
                     f"{torch.cuda.device_count()} visible")
        if args.fp8_recipe is not None:
            need, have = FP8_MIN_CAPABILITY[args.fp8_recipe], torch.cuda.get_device_capability(0)
            if tuple(have) < need:
                ap.error(f"--fp8-recipe {args.fp8_recipe}: Transformer Engine needs compute capability "
                         f">= {need[0]}.{need[1]}, this GPU has {have[0]}.{have[1]}")
    return args


def launch(args, argv: list[str]) -> int:
    from mlrl.procs import kill_tree, torchrun_command

    world = args.tp * args.pp
    if not args.model_shape:  # bad input: one line (tool_errors), before torchrun starts any rank
        from mlrl.bridge import check_layout, spec_for
        from mlrl.modelzoo import resolve_model_dir

        _, arch = spec_for(json.loads((resolve_model_dir(args.hf_dir) / "config.json").read_text()))
        check_layout(arch, tp=args.tp, pp=args.pp)
    env = dict(os.environ, MLRL_BENCH_WORKER="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    tmp = None
    try:
        if args.model_shape:
            tmp = Path(tempfile.mkdtemp(prefix=f"mlrl-bench-{args.model_shape}-"))
            t0 = time.perf_counter()
            write_random_hf_dir(args.model_shape, tmp)
            print(f"bench_train_step: random {args.model_shape} weights in {tmp} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            env[HF_DIR_ENV] = str(tmp)
        cmd = torchrun_command(world, __file__, *argv)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=args.timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            kill_tree(proc.pid)  # torchrun's workers run in sessions of their own
            return 2
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- the two sides ----------------------------------------------------------------------------------
def _batch(vocab: int, args):
    import torch

    from mlrl.experience.batch import MicroBatch

    g = torch.Generator().manual_seed(0)
    n, L = args.samples, args.sample_len
    samples = torch.randint(3, vocab, (n, L), generator=g)
    adv = torch.randn(n, generator=g)
    loss_tokens = n * (L - L // 2)
    mbs = []
    for idx in torch.arange(n).split(args.per_micro_batch):
        k = len(idx)
        mask = torch.zeros(k, L)
        mask[:, L // 2:] = 1.0
        mbs.append(MicroBatch(
            tokens=samples[idx].reshape(-1), position_ids=torch.arange(L).repeat(k),
            cu_seqlens=torch.arange(0, (k + 1) * L, L, dtype=torch.int32), sample_ids=idx.repeat_interleave(L),
            loss_mask=mask.reshape(-1), loss_weight=mask.reshape(-1) / loss_tokens,
            advantages=adv[idx].repeat_interleave(L), rollout_logprobs=torch.zeros(k * L)))
    return samples, mbs


def pg_loss(mb, lp, ent):
    loss = -(mb.loss_weight * (mb.advantages * lp + 0.01 * ent)).sum()
    return loss, {}


def _hf_step(model, opt, mbs, L, clip):
    """One HF train step; the micro-batches may live on the CPU, inputs and loss go to the model's device."""
    import torch

    dev = next(model.parameters()).device
    opt.zero_grad(set_to_none=True)
    for mb in mbs:
        mb = mb.to(dev)
        ids = mb.tokens.view(-1, L)
        logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        first = torch.zeros(ids.shape[0], 1, device=dev)
        lp = torch.cat([first, logp.gather(-1, ids[:, 1:, None])[..., 0]], dim=1)
        ent = torch.cat([first, -(logp.exp() * logp).sum(-1)], dim=1)
        loss, _ = pg_loss(mb, lp.reshape(-1), ent.reshape(-1))
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def _timed(fn, warmup: int, steps: int, sync) -> float:
    """Seconds per call of fn, after `warmup` untimed calls; `sync` waits for all outstanding work."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


def _peak_gb(cuda: bool, *, across_ranks: bool) -> tuple[float, float]:
    """(max allocated, max reserved) GB since the last reset; the maximum over all ranks if asked."""
    import torch
    import torch.distributed as dist

    if not cuda:
        return float("nan"), float("nan")
    t = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                     dtype=torch.float64, device="cuda")
    if across_ranks:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]) / 1e9, float(t[1]) / 1e9


def hf_side(args, hf_dir: Path, mbs) -> tuple[float, tuple[float, float], float]:
    """Seconds per HF train step, its (peak allocated, peak reserved) GB on cuda, and the GB that
    were still allocated when it started (what the mlrl side left behind; 0 on a fresh process)."""
    import torch
    import transformers

    cuda = args.device == "cuda"
    start_gb = 0.0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start_gb = torch.cuda.memory_allocated() / 1e9
        dev = torch.device("cuda", torch.cuda.current_device())
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seconds = _timed(lambda: _hf_step(model, opt, mbs, args.sample_len, 1.0), args.warmup, args.steps,
                     torch.cuda.synchronize if cuda else (lambda: None))
    return seconds, _peak_gb(cuda, across_ranks=False), start_gb


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import transformers

    from mlrl.config.validate import resolve_layout
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

    cuda = args.device == "cuda"
    hf_dir = Path(os.environ[HF_DIR_ENV]) if args.model_shape else resolve_model_dir(args.hf_dir)
    local = int(os.environ.get("LOCAL_RANK", "0"))  # before init_parallel sets this rank's device
    device_gb = torch.cuda.get_device_properties(local).total_memory / 2**30 if cuda else None
    planned = resolve_micro_batches(args, hf_dir, device_gb)
    cfg = bench_config(args, hf_dir)  # its SFT section keeps dp = 1 on tp*pp GPUs; the policy reads no more of it
    layout = resolve_layout(cfg)
    init_parallel(cfg.parallel, layout, seed=0)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    samples, mbs = _batch(vocab, args)
    tokens = samples.numel()

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def mlrl_side(trainer_cfg, *, forward: bool):
        """(train s/step, forward-only s/call or None, (peak allocated, peak reserved) GB, GB still
        allocated when it started) of one mlrl policy, freed afterwards."""
        start = 0.0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated() / 1e9
        policy = MegatronPolicy(cfg.model, cfg.parallel, trainer_cfg, layout, hf_dir=hf_dir, trainable=True)
        train = _timed(partial(policy.update, mbs, pg_loss), args.warmup, args.steps, sync)
        fwd = _timed(partial(policy.compute_logprobs, mbs, 1.0), args.warmup, args.steps, sync) if forward else None
        peak = _peak_gb(cuda, across_ranks=True)
        del policy
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return train, fwd, peak, start

    mg_time, fwd_time, mg_mem, _ = mlrl_side(cfg.trainer, forward=True)
    assert fwd_time is not None
    if dist.get_rank() == 0:  # before the FP8 side, which may fail
        print(f"bench_train_step: mlrl train {tokens / mg_time:.0f} tok/s, forward-only {tokens / fwd_time:.0f} "
              f"tok/s, peak {mg_mem[0]:.1f} GB allocated", flush=True)
    fp8 = None
    if args.fp8_recipe is not None:
        fp8 = mlrl_side(bench_config(args, hf_dir, fp8_recipe=args.fp8_recipe).trainer, forward=False)

    if dist.get_rank() == 0:
        hf = None if args.mlrl_only else hf_side(args, hf_dir, mbs)
        res = {"hf_dir": str(hf_dir), "model_shape": args.model_shape, "device": args.device, "tp": args.tp,
               "pp": args.pp, "tokens_per_step": tokens, "samples": args.samples, "sample_len": args.sample_len,
               "micro_batches": args.micro_batches, "steps": args.steps, "warmup": args.warmup,
               "recompute": args.recompute, **planned}
        if cuda:
            hf_cfg = transformers.AutoConfig.from_pretrained(hf_dir)
            res.update(_cuda_report(args, hf_cfg, tokens, mg_time, fwd_time, hf, mg_mem, dist.get_world_size()))
            if fp8 is not None:
                res.update(_fp8_report(args, hf_cfg, tokens, mg_time, fp8, dist.get_world_size()))
            how = "auto" if planned["micro_batch_tokens_auto"] else "given"
            est = "none" if planned["planned_train_gb"] is None else f"{planned['planned_train_gb']:.1f} GB"
            print(f"bench_train_step: micro_batch_tokens {planned['micro_batch_tokens']} ({how}) -> "
                  f"{args.micro_batches} micro-batches of <= {args.per_micro_batch} samples; planner's bf16 "
                  f"training-phase estimate for {planned['largest_micro_batch_tokens']} tokens: {est} vs measured "
                  f"peak {mg_mem[0]:.1f} GB allocated ({device_gb:.1f} GiB GPU)", flush=True)
            if planned["planned_train_gb"]:
                res["ratio_peak_over_planned"] = mg_mem[0] / planned["planned_train_gb"]
        else:
            assert hf is not None  # --mlrl-only is refused on cpu
            hf_time = hf[0]
            res.update(megatron_tokens_per_s=tokens / mg_time, megatron_forward_tokens_per_s=tokens / fwd_time,
                       hf_tokens_per_s=tokens / hf_time, ratio_megatron_over_hf=hf_time / mg_time,
                       torch_threads_hf=torch.get_num_threads(), megatron_ranks=dist.get_world_size())
            name = hf_dir.name if args.model_shape is None else args.model_shape
            print(f"bench_train_step: {name} tp={args.tp} pp={args.pp}, {tokens} tokens/step "
                  f"({args.samples} x {args.sample_len}, {args.micro_batches} micro-batches): Megatron "
                  f"{res['megatron_tokens_per_s']:.0f} tok/s, HF {res['hf_tokens_per_s']:.0f} tok/s, "
                  f"ratio Megatron/HF = {res['ratio_megatron_over_hf']:.2f}", flush=True)
        print(json.dumps(res), flush=True)
        if cuda:
            if args.mlrl_only:
                print(f"ratio peak_over_planned: {res.get('ratio_peak_over_planned', float('nan')):.3f}", flush=True)
            else:
                print(f"ratio mlrl_over_hf: {res['ratio_mlrl_over_hf']:.3f}", flush=True)
            if fp8 is not None:
                print(f"ratio fp8_over_bf16: {res['ratio_fp8_over_bf16']:.3f}", flush=True)
        else:
            print(f"ratio megatron_over_hf: {res['ratio_megatron_over_hf']:.3f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _cuda_report(args, hf_cfg, tokens, mg_time, fwd_time, hf, mg_mem, world) -> dict:
    """The GPU result record (tok/s, MFU, memory per side) and its human-readable lines; `hf` is
    (seconds, peak GB, GB held before it), or None under --mlrl-only."""
    import torch

    gpu = torch.cuda.get_device_name()
    train_f, fwd_f = train_flops_per_token(hf_cfg, args.sample_len), forward_flops_per_token(hf_cfg, args.sample_len)
    mg_tps, fwd_tps = tokens / mg_time, tokens / fwd_time
    r = {"gpu": gpu, "gpus_mlrl": world, "peak_tflops": args.peak_tflops, "matmul_params": matmul_params(hf_cfg),
         "train_flops_per_token": train_f,
         "mlrl_train_tokens_per_s": mg_tps, "mlrl_forward_tokens_per_s": fwd_tps,
         "mlrl_forward_over_train": fwd_tps / mg_tps,
         "mlrl_train_mfu": mfu(train_f, mg_tps, args.peak_tflops, world),
         "mlrl_forward_mfu": mfu(fwd_f, fwd_tps, args.peak_tflops, world),
         "mlrl_peak_allocated_gb": mg_mem[0], "mlrl_peak_reserved_gb": mg_mem[1]}
    name = args.model_shape or Path(args.hf_dir).name
    head = (f"bench_train_step: {name} on {world} x {gpu} (MFU vs {args.peak_tflops:g} TFLOP/s bf16), "
            f"{tokens} tokens/step ({args.samples} x {args.sample_len}, {args.micro_batches} micro-batches)")
    print(f"{head}, mlrl tp={args.tp} pp={args.pp}: train {mg_tps:.0f} tok/s (MFU {r['mlrl_train_mfu']:.1%}), "
          f"forward-only {fwd_tps:.0f} tok/s (MFU {r['mlrl_forward_mfu']:.1%}), forward/train "
          f"{r['mlrl_forward_over_train']:.2f}, peak {mg_mem[0]:.1f} GB allocated / {mg_mem[1]:.1f} GB reserved",
          flush=True)
    if hf is None:
        return r
    hf_time, hf_mem, hf_start_gb = hf
    hf_tps = tokens / hf_time
    r.update({"hf_train_tokens_per_s": hf_tps, "hf_train_mfu": mfu(train_f, hf_tps, args.peak_tflops, 1),
              "hf_peak_allocated_gb": hf_mem[0], "hf_peak_reserved_gb": hf_mem[1],
              "hf_start_allocated_gb": hf_start_gb, "ratio_mlrl_over_hf": mg_tps / hf_tps})
    print(f"{head}, HF transformers (sdpa, fused AdamW): train {hf_tps:.0f} tok/s (MFU {r['hf_train_mfu']:.1%}), "
          f"peak {hf_mem[0]:.1f} GB allocated / {hf_mem[1]:.1f} GB reserved "
          f"({hf_start_gb:.1f} GB held before it)", flush=True)
    return r


def _fp8_report(args, hf_cfg, tokens, bf16_time, fp8, world) -> dict:
    """The FP8 side's record (train tok/s, MFU against the bf16 peak, memory) and its line."""
    fp8_time, _, fp8_mem, fp8_start = fp8
    tps = tokens / fp8_time
    r = {"fp8_recipe": args.fp8_recipe, "mlrl_fp8_train_tokens_per_s": tps,
         "mlrl_fp8_train_mfu": mfu(train_flops_per_token(hf_cfg, args.sample_len), tps, args.peak_tflops, world),
         "mlrl_fp8_peak_allocated_gb": fp8_mem[0], "mlrl_fp8_peak_reserved_gb": fp8_mem[1],
         "mlrl_fp8_start_allocated_gb": fp8_start, "ratio_fp8_over_bf16": bf16_time / fp8_time}
    print(f"bench_train_step: mlrl FP8 ({args.fp8_recipe}): train {tps:.0f} tok/s (bf16-equivalent MFU "
          f"{r['mlrl_fp8_train_mfu']:.1%}), {r['ratio_fp8_over_bf16']:.2f}x the bf16 step, peak "
          f"{fp8_mem[0]:.1f} GB allocated / {fp8_mem[1]:.1f} GB reserved ({fp8_start:.1f} GB held before it)",
          flush=True)
    return r


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if os.environ.get("MLRL_BENCH_WORKER") == "1":
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_train_step", main))
