"""One RL step's generation on CPU, three ways, on the shapes of tools/bench_learning.py.

    python tools/bench_generate.py [--shapes repeat_digit,copy_pair,reverse_digits,smollm2_arith] [--repeats 4]

For each shape (model, prompts x samples per prompt x new tokens), the same prompts are generated
- **served**: mlrl's rollout path: a vLLM server started as mlrl starts it (`EngineServer`, the
  pool's thread count), one `EngineClient.generate_n` request per prompt group, all at once (what
  `EnginePool.agenerate_group` sends in a step), sampled logprobs returned, per-request seeds;
- **engine**: vLLM's engine alone, `LLM.generate` in a process of its own with the same engine
  settings and worker extension (no HTTP, no API server, no driver);
- **hf**: transformers' `generate` with sampling, in a process of its own with one torch thread
  per core: what TRL's GRPOTrainer runs with `use_vllm=False` (tools/bench_learning.py's TRL side).

Every sample is exactly `new tokens` long (EOS suppressed on all three), so the three do the same
work. The first batch of each is a warm-up; the medians of the rest are printed, with generated
tokens per second. The last lines are `ratio <shape>_served_over_hf: x` per shape and then
`ratio served_over_hf_max: x`, the worst shape (< 1: mlrl's rollout is the faster).

What it is for: `timing/rollout` is where tools/bench_learning.py's wall-time ratios are lost on
the tiny tasks, and this separates what the engine costs from what serving it costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tool_errors import InputError  # tools/ is on sys.path when run as a script


@dataclass(frozen=True)
class Shape:
    model: str
    prompts: int
    group: int
    new_tokens: int
    prompt_len: int
    max_model_len: int = 256
    kv_cache_gb: float = 1.0
    seeded: bool = True  # per-request sampling seeds, as the task's recipe sets rollout.sampling.seed


# the shapes of tools/bench_learning.py's tasks; random prompts about as long as theirs (the tiny tasks' chat-templated
# prompts are 7-10 tokens, smollm2_arith's ~60)
SHAPES: dict[str, Shape] = {
    "copy_digit": Shape("builtin:tiny-llama", 32, 16, 1, 6),
    "copy_pair": Shape("builtin:tiny-llama", 64, 8, 2, 7),
    "reverse_digits": Shape("builtin:tiny-llama", 128, 4, 4, 9),
    "repeat_digit": Shape("builtin:tiny-llama", 32, 16, 16, 6),
    "smollm2_arith": Shape("builtin:smollm2-135m-instruct", 8, 4, 48, 64, max_model_len=512, kv_cache_gb=2.0,
                           seeded=False),  # launch/smollm2_cpu.yaml sets no sampling seed
}
SEED = 1


def prompts_for(shape: Shape, vocab: int) -> list[list[int]]:
    """Random prompt token ids (fixed seed), avoiding the first ids (pad / BOS / EOS)."""
    rng = random.Random(SEED)
    return [[rng.randrange(3, vocab) for _ in range(shape.prompt_len)] for _ in range(shape.prompts)]


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# ---- served: mlrl's engine server and client ---------------------------------------------------
def run_served(shape: Shape, model_dir: Path, prompts: list[list[int]], repeats: int, tmp: Path) -> list[float]:
    from mlrl.config.schema import RolloutConfig
    from mlrl.rollout import EngineServer, ServerSpec
    from mlrl.rollout.pool import engine_omp_threads

    rc = RolloutConfig(max_model_len=shape.max_model_len, cpu_kv_cache_gb=shape.kv_cache_gb)
    spec = ServerSpec.from_config(rc, "bench-served", model_dir, "float32", "bench", log_path=str(tmp / "served.log"),
                                  omp_threads=engine_omp_threads(rc))
    server = EngineServer(spec)
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        return asyncio.run(_served_batches(server, shape, prompts, repeats))
    finally:
        server.stop()


async def _served_batches(server, shape: Shape, prompts: list[list[int]], repeats: int) -> list[float]:
    from mlrl.rollout import EngineClient
    from mlrl.types import GenerationHyperparameters

    client = EngineClient(server.url, server.spec.token, name=server.spec.name)
    times = []
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            groups = await asyncio.gather(*(
                client.generate_n(p, GenerationHyperparameters(max_new_tokens=shape.new_tokens,
                                                               min_new_tokens=shape.new_tokens,
                                                               seed=SEED + 1000 * i if shape.seeded else None),
                                  shape.group, request_id=f"b{r}-{i}", default_version=0)
                for i, p in enumerate(prompts)))
            times.append(time.perf_counter() - t0)
            got = sum(len(s.tokens) for g in groups for s in g)
            assert got == shape.prompts * shape.group * shape.new_tokens, f"served: {got} tokens"
    finally:
        await client.aclose()
    return times


# ---- engine: vLLM's LLM in a process of its own --------------------------------------------------
def engine_worker(shape: Shape, model_dir: Path, prompts: list[list[int]], repeats: int) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=shape.max_model_len,
              logprobs_mode="processed_logprobs", distributed_executor_backend="uni", disable_log_stats=True,
              worker_extension_cls="mlrl.rollout.worker_ext.MlrlWorkerExtension")
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(n=shape.group, max_tokens=shape.new_tokens, min_tokens=shape.new_tokens, temperature=1.0,
                             logprobs=0, seed=SEED + 1000 * i if shape.seeded else None, detokenize=False)
              for i in range(len(prompts))]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(reqs, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        got = sum(len(c.token_ids) for o in out for c in o.outputs)
        assert got == shape.prompts * shape.group * shape.new_tokens, f"engine: {got} tokens"
    return times


# ---- hf: transformers' generate in a process of its own -----------------------------------------
def hf_worker(shape: Shape, model_dir: Path, prompts: list[list[int]], repeats: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)  # TRL's runs in tools/bench_learning.py (--trl-threads default)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts).repeat_interleave(shape.group, 0)
    eos = model.config.eos_token_id
    eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=shape.new_tokens, min_new_tokens=shape.new_tokens,
                                 pad_token_id=eos)
        times.append(time.perf_counter() - t0)
        got = int((out[:, ids.shape[1]:] != eos).sum())  # EOS pads a row that stopped early: it counts short
        assert got == shape.prompts * shape.group * shape.new_tokens, f"hf: {got} tokens"
    return times


def in_subprocess(kind: str, shape_name: str, repeats: int) -> list[float]:
    """Run `--worker kind` in a fresh interpreter (own threads, own imports); its seconds per batch."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each way sets its own threads
    if kind == "engine":
        from mlrl.config.schema import RolloutConfig
        from mlrl.rollout.pool import engine_omp_threads
        from mlrl.rollout.server import ServerSpec, server_env

        rc = RolloutConfig(cpu_kv_cache_gb=SHAPES[shape_name].kv_cache_gb)
        spec = ServerSpec.from_config(rc, "bench-engine", Path("."), "float32", "bench",
                                      omp_threads=engine_omp_threads(rc))
        env = server_env(spec)  # the served engine's OpenMP, KV-cache and executor settings
    p = subprocess.run([sys.executable, __file__, "--worker", kind, "--shapes", shape_name, "--repeats", str(repeats)],
                       capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("TIMES ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"bench_generate: the {kind} worker for {shape_name} failed (exit {p.returncode}):\n"
                           + "\n".join((p.stdout + p.stderr).splitlines()[-25:]))
    return json.loads(lines[-1][len("TIMES "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="repeat_digit,copy_pair,reverse_digits,smollm2_arith",
                    help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=4, help="batches per way (the first is a warm-up)")
    ap.add_argument("--worker", choices=["engine", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    bad = [s for s in names if s not in SHAPES]
    if bad or not names:
        raise InputError(f"--shapes: unknown {', '.join(bad) or '(none)'}; known: {', '.join(SHAPES)}")
    if args.repeats < 2:
        raise InputError(f"--repeats must be >= 2 (the first batch is a warm-up), got {args.repeats}")
    if not args.worker:
        # the CPU comparison: every way on the cores (mlrl's engines and HF both on CPU), the served
        # engine with the pool's thread count (its environment overrides an inherited OMP_NUM_THREADS)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.pop("OMP_NUM_THREADS", None)
    from mlrl.modelzoo import resolve_model_dir

    for name in names:  # every model folder before the first engine starts
        resolve_model_dir(SHAPES[name].model)

    if args.worker:
        shape = SHAPES[names[0]]
        md = resolve_model_dir(shape.model)
        fn = engine_worker if args.worker == "engine" else hf_worker
        print("TIMES " + json.dumps(fn(shape, md, prompts_for(shape, vocab_size(md)), args.repeats)), flush=True)
        return 0

    from mlrl.config.schema import RolloutConfig
    from mlrl.rollout.pool import engine_omp_threads

    print(f"threads: served and engine {engine_omp_threads(RolloutConfig())} (mlrl's pool rule), "
          f"hf {os.cpu_count()} (TRL's runs)", flush=True)
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mlrl-bench-generate-") as tmp:
        for name in names:
            shape = SHAPES[name]
            md = resolve_model_dir(shape.model)
            prompts = prompts_for(shape, vocab_size(md))
            tokens = shape.prompts * shape.group * shape.new_tokens
            med = {}
            for way in ("served", "engine", "hf"):
                times = (run_served(shape, md, prompts, args.repeats, Path(tmp)) if way == "served"
                         else in_subprocess(way, name, args.repeats))
                med[way] = statistics.median(times[1:])
            print(f"{name}: {shape.model.split(':')[-1]}, {shape.prompts} prompts x {shape.group} samples x "
                  f"{shape.new_tokens} tokens ({tokens} tokens)", flush=True)
            for way, s in med.items():
                print(f"  {way:7s} {s:7.3f} s  {tokens / s:9.0f} tok/s  ({s / tokens * 1e6:6.1f} us/token)", flush=True)
            ratios[name] = med["served"] / med["hf"]
    for name, r in ratios.items():
        print(f"ratio {name}_served_over_hf: {r:.3f}")
    print(f"ratio served_over_hf_max: {max(ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_generate", main))
