"""End-to-end GRPO throughput: a colocated mlrl run on one device, launched as users launch it,
with its step-time breakdown and the weight-sync ("refit") time against a plain copy.

    python tools/bench_e2e_gpu.py                        # GPU: qwen3-1.7b shape, 64 x 8 x 512, 1 + 3 steps
    python tools/bench_e2e_gpu.py --prompts 32 --steps 5 rollout.gpu_memory_utilization=0.5
    .venv/bin/python tools/bench_e2e_gpu.py --device cpu --model-shape tiny \\
        --prompts 2 --group-size 2 --max-new-tokens 8 --steps 1 --warmup 1

What runs: `python -m mlrl.launch --config <tmp>/bench.yaml [overrides...]`, a GRPO run with
`cluster.placement=colocated` (trainer rank and vLLM engine on the same device) on the
`--model-shape` shape with random weights (`bench_train_step.write_random_hf_dir`, bf16
safetensors in a temp dir; no download), `--prompts` prompts x `--group-size` samples per step,
`--warmup` + `--steps` steps. Device settings:
- cuda: `cluster.gpus_per_node=1`, `model.dtype=bfloat16`, `weight_sync.transport=cuda_ipc`,
  vLLM with CUDA graphs (`rollout.enforce_eager=false`, as launch/qwen3_8b_grpo.yaml),
  `rollout.gpu_memory_utilization=0.6` (mlrl's planner: a KV cache for ~690 sequences of 576
  tokens, so all 512 at once, and room for the trainer's parameters beside it; planned peak
  55.5 GiB of 80, in the train phase; tests/unit/loop/test_bench_e2e_gpu.py checks that the plan
  fits), `trainer.micro_batch_tokens=8192`.
- cpu: `cluster.gpus_per_node=0`, `model.dtype=float32`, the broadcast transport (gloo); vLLM's
  CPU build has no sleep mode, so the engine keeps its memory (README: colocated placement).
Both: `algorithm.kl_coef=0.001` (so the reference model's logprobs are computed each step),
one optimizer update per step (mlrl then skips the separate old-policy forward, see
mlrl/update.py; `trainer.mini_batches_per_step=4` adds it), no checkpoint, no HF export. Extra
`a.b=c` arguments are appended to the launch's overrides and win. `--run-dir DIR` keeps the run
folder (metrics.jsonl, engine and trainer logs, and the launch's output as launch.log); by default
it lives in a temp dir deleted at the end, with the model.

The task is `synthetic:copy_digit` with reward `exact_match`; the model is random, so rewards
are ~0 and GRPO's advantages ~0, which changes no timing (the trainer runs every pass
regardless). Random weights rarely emit EOS and a short answer would under-count the work, so
the workflow is `rlvr` with `min_new_tokens = max_new_tokens` (vLLM's `min_tokens`: EOS is
suppressed until then; `fixed_length_rlvr` below): every sample is `--max-new-tokens` long. The
report prints the measured mean length anyway.

The tokenizer: the shapes' public tokenizers cannot be downloaded, and mlrl's builtin models use
a word-level vocabulary of 72 entries (mlrl.modelzoo.SPECIALS + WORDS: it covers the synthetic
tasks). `write_tokenizer` writes that vocabulary padded with `<unusedN>` entries to exactly the
shape's vocab_size (151936 for Qwen3), with BOS / EOS at the shape's ids, so every id the random
model samples decodes and the tokenizer and the model agree on the vocabulary size.

Numbers (means over the `--steps` timed steps; the `--warmup` steps before them are not used;
all from the run's metrics.jsonl except the copy and the memory):
- generated tokens per step = groups/samples x response/tokens_mean (every sample's response
  tokens); generated tok/s per GPU = sum of generated tokens / sum of timing/step / devices
  (1: one GPU, or the CPU); also the generation rate, tokens / timing/rollout (the seconds the
  engine was generating).
- step-time breakdown: every `timing/<phase>` key (mlrl/metrics/timer.py): rollout, reward,
  logprobs (reference + old-policy forwards), train, sync, and the colocated phases sleep /
  wake (engines) and offload / reload (trainer state); they and timing/other sum to timing/step.
  Sub-keys (timing/train/forward_backward, timing/sync/transfer, ...) are printed indented.
- refit seconds = timing/sync: the weight sync of one step (pause, transfer into the engine,
  vLLM's apply, checksum / canary verification), without the colocated engine wake and trainer
  offload around it (those are timing/wake and timing/offload, printed beside it).
- peak memory: mlrl logs none. cuda: the device's used memory (NVML, all processes: trainer,
  engine and their CUDA contexts), sampled every 0.2 s during the run, its maximum and the value
  before the launch. cpu: the sum of the resident set sizes of the launched process tree
  (psutil), sampled every 0.5 s (shared pages counted per process, so an upper bound).
- copy seconds: after the run, in this process, a device-to-device copy of the model's parameter
  bytes in the engine dtype (parameter count from the safetensors headers, tied embeddings once,
  x 2 bytes bf16 / 4 bytes fp32) between two uint8 buffers: cuda, torch CUDA events around
  `dst.copy_(src)`; cpu, a host memcpy (`copy_` of CPU tensors) timed with perf_counter. Median of
  10 after 3 untimed copies.
- the last line, `ratio refit_vs_copy: x` = refit seconds / copy seconds (1 would mean the sync
  runs at the device's copy bandwidth; mlrl's sync moves the weights once plus checksums and a
  canary forward).

Bad flags exit 2 with one line naming the flag, before any model is written or process started
(tools/tool_errors.py); config errors from the overrides, before the launch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))  # bench_train_step, tool_errors (also when loaded as a module by the tests)
sys.path.insert(1, str(REPO))

from bench_train_step import SHAPES, shape_config, write_random_hf_dir  # noqa: E402
from tool_errors import InputError  # noqa: E402

NAME = "bench_e2e_gpu"
WORKFLOW = f"{NAME}:fixed_length_rlvr"  # imported by the launched run (tools/ on its PYTHONPATH)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# timing/<phase> keys in print order (mlrl.metrics.timer.PHASES, then the remainder and the total)
PHASE_ORDER = ("rollout", "reward", "logprobs", "train", "sync", "sleep", "wake", "offload", "reload", "eval",
               "checkpoint", "other")
GiB = float(1 << 30)


# ---- the workflow the run uses -----------------------------------------------------------------------
def fixed_length_rlvr(reward_fn: Any, gconfig: Any, tokenizer: Any, reward_timeout_s: float = 15.0,
                      reward_workers: int | None = None) -> Any:
    """mlrl's `rlvr` workflow with EOS suppressed until max_new_tokens (vLLM min_tokens): every
    response of a random-weight model is exactly max_new_tokens long. A workflow factory: mlrl
    passes the arguments it declares (mlrl.workflow.registry.build_workflow)."""
    from mlrl.workflow.builtin.rlvr import RLVRWorkflow

    return RLVRWorkflow(reward_fn=reward_fn, gconfig=gconfig.new(min_new_tokens=gconfig.max_new_tokens),
                        tokenizer=tokenizer, reward_timeout_s=reward_timeout_s, reward_workers=reward_workers)


# ---- arguments (pure; tests/unit/loop/test_bench_e2e_gpu.py) ------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (tool_errors: exit 2), not usage + message."""

    def error(self, message: str):
        raise InputError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(prog="bench_e2e_gpu.py", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (one GPU) or cpu")
    ap.add_argument("--model-shape", default="qwen3-1.7b", help=f"random weights of: {', '.join(sorted(SHAPES))}")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="tokens per sample (EOS suppressed before)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--run-dir", default=None, help="keep the run folder here (default: a temp dir, deleted)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is killed")
    ap.add_argument("overrides", nargs="*", help="extra a.b=c config overrides for the launch")
    args = ap.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace, cuda_available: Callable[[], bool] | None = None) -> None:
    """Raise InputError naming the first bad flag."""
    if args.device not in ("cuda", "cpu"):
        raise InputError(f"--device {args.device!r}: expected cuda or cpu")
    if args.model_shape not in SHAPES:
        raise InputError(f"--model-shape {args.model_shape!r}: known shapes: {', '.join(sorted(SHAPES))}")
    for flag, value, low in (("--prompts", args.prompts, 1), ("--group-size", args.group_size, 2),
                             ("--max-new-tokens", args.max_new_tokens, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0)):
        if value < low:
            why = " (GRPO compares the samples of a group)" if flag == "--group-size" else ""
            raise InputError(f"{flag}={value}: must be >= {low}{why}")
    if args.timeout <= 0:
        raise InputError(f"--timeout={args.timeout}: must be > 0")
    for o in args.overrides:
        if "=" not in o or o.startswith("-"):
            raise InputError(f"override {o!r}: expected a.b=c (or an unknown flag)")
    if args.device == "cuda":
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available
        if not cuda_available():
            raise InputError("--device cuda: torch.cuda.is_available() is False on this machine (no GPU visible, "
                             "or a CPU build of torch); run on a GPU machine or pass --device cpu --model-shape tiny")


# ---- the model folder ----------------------------------------------------------------------------------
def write_tokenizer(out: Path, vocab_size: int, bos_id: int | None, eos_id: int | None) -> None:
    """mlrl's word-level tokenizer (modelzoo.SPECIALS + WORDS, its chat template) padded with
    `<unusedN>` to exactly vocab_size entries; BOS / EOS at the given ids (renamed `<|bos|>` /
    `<|eos|>` when they fall among the padding, the word tokenizer's `<s>` / `</s>` otherwise)."""
    from mlrl.modelzoo import SPECIALS, WORDS, build_word_tokenizer

    names = SPECIALS + WORDS
    if vocab_size < len(names):
        raise InputError(f"--model-shape: vocab_size {vocab_size} is smaller than the word vocabulary ({len(names)})")
    vocab = names + [f"<unused{i}>" for i in range(len(names), vocab_size)]
    special: dict[str, str] = {}
    for role, tid, default in (("bos", bos_id, "<s>"), ("eos", eos_id, "</s>")):
        if tid is None or not 0 <= tid < vocab_size:
            special[role] = default
        elif tid < len(names):
            special[role] = vocab[tid]
        else:
            vocab[tid] = special[role] = f"<|{role}|>"
    build_word_tokenizer(out, vocab, bos_token=special["bos"], eos_token=special["eos"])


def write_model(shape: str, out: Path) -> Path:
    """Random weights of `shape` (bench_train_step) plus the padded word tokenizer."""
    write_random_hf_dir(shape, out)
    cfg = shape_config(shape)
    write_tokenizer(out, cfg.vocab_size, getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None))
    return out


def safetensors_numel(folder: Path) -> int:
    """Elements of every tensor in the folder's *.safetensors files, read from their JSON headers
    (8-byte little-endian length, then the header); a tied embedding is stored once."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total


# ---- the run's config ----------------------------------------------------------------------------------
def run_config(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """The recipe written to <tmp>/bench.yaml (JSON is YAML)."""
    cuda = args.device == "cuda"
    prompt_tokens = 64  # the synthetic prompts in the chat template are ~8 words
    n = args.prompts * args.group_size
    return {
        "model": {"hf_dir": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "parallel": {"tp": 1, "pp": 1},
        "trainer": {"lr": 1e-6, "prompts_per_step": args.prompts, "samples_per_prompt": args.group_size,
                    "micro_batch_tokens": 8192 if cuda else 4096, "total_steps": args.warmup + args.steps,
                    "grad_clip": 1.0},
        "rollout": {"num_engines": 1, "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens,
                                                   "seed": 1},
                    "max_concurrent_requests": n, "max_model_len": prompt_tokens + args.max_new_tokens,
                    "enforce_eager": not cuda, **({"gpu_memory_utilization": 0.6} if cuda else {})},
        "weight_sync": {"transport": "cuda_ipc" if cuda else "broadcast"},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo", "kl_coef": 0.001, "kl_estimator": "k3"},
        "data": {"train": "synthetic:copy_digit", "max_prompt_tokens": prompt_tokens,
                 "num_synthetic": max(512, args.prompts * (args.warmup + args.steps))},
        "workflow": {"name": WORKFLOW, "reward": "exact_match", "max_concurrency": n},
        "checkpoint": {"save_at_end": False, "hf_export_at_end": False, "resume": "none"},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "plot": False, "tensorboard": False},
        "cluster": {"nodes": 1, "gpus_per_node": 1 if cuda else 0, "placement": "colocated"},
    }


# ---- metrics -> report (pure) --------------------------------------------------------------------------
class StepStats(NamedTuple):
    """Means over the timed steps of one run's metrics.jsonl (a NamedTuple, not a dataclass: the
    tests load this file without registering it in sys.modules, which dataclasses need)."""

    steps: list[int]
    gen_tokens: float                  # generated (response) tokens per step
    samples: float                     # samples per step
    mean_len: float                    # mean response length, tokens
    truncated: float                   # fraction of samples cut at max_new_tokens
    step_s: float                      # timing/step
    rollout_s: float                   # timing/rollout
    refit_s: float                     # timing/sync
    sync_bytes: float                  # weight_sync/bytes (what the sync sent)
    phases: dict[str, float]           # timing/<phase>
    details: dict[str, float]          # timing/<phase>/<part>


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_stats(records: list[dict[str, Any]], warmup: int) -> StepStats:
    """StepStats of the records after the first `warmup` steps (ValueError when none is left or a
    needed metric is missing)."""
    timed = [r for r in records if int(r["step"]) > warmup]
    if not timed:
        raise ValueError(f"metrics.jsonl has steps {[r['step'] for r in records]}: none after the {warmup} "
                         "warm-up step(s)")
    need = ("groups/samples", "response/tokens_mean", "timing/step", "timing/rollout", "timing/sync")
    for r in timed:
        missing = [k for k in need if k not in r]
        if missing:
            raise ValueError(f"metrics.jsonl step {r['step']} lacks {', '.join(missing)}")

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in timed)

    tokens = [float(r["groups/samples"]) * float(r["response/tokens_mean"]) for r in timed]
    keys = sorted({k for r in timed for k in r if k.startswith("timing/")})
    # the parts of timing/step (timing/overlap, async runs only, is generation hidden under training: not a part)
    phases = {k.split("/", 1)[1]: mean(k) for k in keys if k.count("/") == 1 and k not in ("timing/step",
                                                                                            "timing/overlap")}
    details = {k.split("/", 1)[1]: mean(k) for k in keys if k.count("/") == 2}
    return StepStats(steps=[int(r["step"]) for r in timed], gen_tokens=statistics.fmean(tokens),
                     samples=mean("groups/samples"), mean_len=mean("response/tokens_mean"),
                     truncated=mean("response/truncated_frac"), step_s=mean("timing/step"),
                     rollout_s=mean("timing/rollout"), refit_s=mean("timing/sync"),
                     sync_bytes=mean("weight_sync/bytes"), phases=phases, details=details)


def ratio_refit_vs_copy(refit_s: float, copy_s: float) -> float:
    if copy_s <= 0:
        raise ValueError(f"copy time {copy_s} s: must be > 0")
    return refit_s / copy_s


def report(stats: StepStats, *, devices: int, device: str, copy_s: float, copy_bytes: int, memory: str,
           max_new_tokens: int) -> list[str]:
    """The bench's output lines; the last is `ratio refit_vs_copy: x`."""
    per_dev = stats.gen_tokens / stats.step_s / devices
    unit = "GPU" if device == "cuda" else "device (CPU)"
    lines = [
        f"steps timed: {', '.join(map(str, stats.steps))}",
        f"samples per step: {stats.samples:.0f}, mean response length {stats.mean_len:.1f} tokens "
        f"(max_new_tokens {max_new_tokens}; {stats.truncated:.0%} reached it)",
        f"generated tokens per step: {stats.gen_tokens:.0f}",
        f"generated tok/s per {unit}: {per_dev:.1f}  (tokens per step / step wall time / {devices})",
        f"generation tok/s: {stats.gen_tokens / stats.rollout_s:.1f}  (tokens per step / timing/rollout, the "
        "engine's busy time)" if stats.rollout_s > 0 else "generation tok/s: n/a (timing/rollout is 0)",
        f"step time: {stats.step_s:.3f} s; breakdown (s, mean per step):",
    ]
    order = [p for p in PHASE_ORDER if p in stats.phases] + sorted(set(stats.phases) - set(PHASE_ORDER))
    for p in order:
        share = stats.phases[p] / stats.step_s if stats.step_s > 0 else 0.0
        lines.append(f"  {p:<20}{stats.phases[p]:>9.3f}  {share:>6.1%}")
        for d in sorted(k for k in stats.details if k.startswith(p + "/")):
            lines.append(f"    {d.split('/', 1)[1]:<18}{stats.details[d]:>9.3f}")
    gbps = copy_bytes / copy_s / 1e9 if copy_s > 0 else 0.0
    lines += [
        f"refit (timing/sync): {stats.refit_s:.3f} s per step ({stats.sync_bytes / 1e6:.1f} MB sent by the sync); "
        f"engine wake {stats.phases.get('wake', 0.0):.3f} s, trainer offload {stats.phases.get('offload', 0.0):.3f} s",
        f"copy of the parameter bytes ({copy_bytes / 1e6:.1f} MB, {device}): {copy_s * 1e3:.3f} ms ({gbps:.1f} GB/s)",
        f"peak memory: {memory}",
        f"ratio refit_vs_copy: {ratio_refit_vs_copy(stats.refit_s, copy_s):.3f}",
    ]
    return lines


# ---- measurements in this process ----------------------------------------------------------------------
def copy_seconds(nbytes: int, device: str, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of `dst.copy_(src)` for two uint8 buffers of nbytes on `device`, after
    `warmup` untimed copies (first touch of the pages, the CPU thread pool's start: the first
    CPU copy of 1 MB took 4.5 ms here, the next ones 0.04 ms)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(warmup + repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i >= warmup:
            times.append(seconds)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


class MemoryPeak:
    """Peak memory of the run, sampled in a thread (module docstring: what each device counts)."""

    def __init__(self, device: str):
        self.device = device
        self.peak = self.baseline = 0.0
        self.how = ""
        self.pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read: Callable[[], float] | None = None
        self.period = 0.2 if device == "cuda" else 0.5

    def start(self, pid: int | None = None) -> None:
        self.pid = pid
        self._read = self._gpu_reader() if self.device == "cuda" else self._rss
        if self._read is None:
            return
        self.baseline = self.peak = self._read() if self.device == "cuda" else 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._read is not None
        while not self._stop.wait(self.period):
            try:
                self.peak = max(self.peak, self._read())
            except Exception:  # a process that exits between listing and reading
                continue

    def stop(self) -> str:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._read is None:
            return f"not measured ({self.how})"
        if self.device == "cuda":
            return (f"{self.peak / GiB:.2f} GiB used on the GPU ({self.how}, device-wide, sampled every "
                    f"{self.period} s; {self.baseline / GiB:.2f} GiB in use before the launch)")
        return (f"{self.peak / GiB:.2f} GiB host RSS (summed over the run's processes, psutil, sampled every "
                f"{self.period} s; no GPU)")

    def _rss(self) -> float:
        import psutil

        if self.pid is None:
            return 0.0
        root = psutil.Process(self.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _gpu_reader(self) -> Callable[[], float] | None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        try:
            try:  # nvidia-ml-py (a vLLM dependency); older vLLMs carry a copy
                pynvml = importlib.import_module("pynvml")
            except ImportError:
                pynvml = importlib.import_module("vllm.third_party.pynvml")
            pynvml.nvmlInit()
            handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                      else pynvml.nvmlDeviceGetHandleByIndex(int(visible)))
            self.how = f"NVML, GPU {visible}"
            return lambda: float(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception as e:  # no NVML binding: nvidia-smi
            if shutil.which("nvidia-smi") is None:
                self.how = f"no NVML ({type(e).__name__}: {e}) and no nvidia-smi"
                return None
            self.how = f"nvidia-smi, GPU {visible}"

            def smi() -> float:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", visible], capture_output=True, text=True, timeout=10).stdout
                return float(out.split()[0]) * (1 << 20)
            return smi


# ---- main ----------------------------------------------------------------------------------------------
def _launch(cfg_path: Path, overrides: list[str], log_path: Path, timeout: float, mem: MemoryPeak) -> str | None:
    """Run the launch to its end; None when it exited 0, else why not. The launch runs in a
    session of its own; if this process is interrupted (Ctrl-C, SIGTERM) or `timeout` passes, the
    launch gets SIGTERM (mlrl tears its trainer ranks and engines down), then SIGKILL 60 s later."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [str(TOOLS), str(REPO), os.environ.get("PYTHONPATH", "")] if p))
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", str(cfg_path), *overrides]
    print(f"{NAME}: {' '.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        mem.start(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException as e:  # the timeout, Ctrl-C, SIGTERM (main turns it into SystemExit)
            _stop(proc)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return f"it did not finish within --timeout {timeout:.0f} s and was stopped"
    return None if rc == 0 else f"exit {rc}"


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the launch, remove the tmp dir
    tmp = Path(tempfile.mkdtemp(prefix=f"mlrl-bench-e2e-{args.model_shape}-"))
    try:
        run_dir = Path(args.run_dir).resolve() if args.run_dir else tmp / "run"
        if run_dir.exists() and any(run_dir.iterdir()):
            raise InputError(f"--run-dir {run_dir}: exists and is not empty")
        t0 = time.perf_counter()
        model_dir = write_model(args.model_shape, tmp / "model")
        print(f"{NAME}: random {args.model_shape} weights + tokenizer in {model_dir} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        cfg_path = tmp / "bench.yaml"
        cfg_path.write_text(json.dumps(run_config(args, model_dir, run_dir), indent=1) + "\n")
        from mlrl.config import load_config, validate

        cfg = load_config(cfg_path, list(args.overrides))
        validate(cfg)  # a bad override: one line (tool_errors), before the launch
        mem = MemoryPeak(args.device)
        t0 = time.perf_counter()
        log_path = tmp / "launch.log"
        failed = _launch(cfg_path, list(args.overrides), log_path, args.timeout, mem)
        memory = mem.stop()
        if args.run_dir and run_dir.is_dir():
            log_path = Path(shutil.copy(log_path, run_dir / "launch.log"))
        if failed:
            tail = log_path.read_text(errors="replace")[-6000:]
            logs = f"engine and trainer logs in {run_dir}" if args.run_dir else "--run-dir DIR keeps the engine and " \
                "trainer logs"
            raise SystemExit(f"{NAME}: the run failed: {failed} (its output, last 6000 characters, follows; "
                             f"{logs}):\n{tail}")
        print(f"{NAME}: the run took {time.perf_counter() - t0:.1f} s (start-up included)", flush=True)
        stats = step_stats(read_metrics(run_dir / "metrics.jsonl"), args.warmup)
        copy_bytes = safetensors_numel(model_dir) * DTYPE_BYTES[cfg.model.dtype]  # model.dtype: the engines' too
        copy_s = copy_seconds(copy_bytes, args.device)
        for line in report(stats, devices=1, device=args.device, copy_s=copy_s, copy_bytes=copy_bytes,
                           memory=memory, max_new_tokens=args.max_new_tokens):
            print(line, flush=True)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run(NAME, main))
