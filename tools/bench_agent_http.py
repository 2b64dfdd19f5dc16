"""The HTTP client agent code talks through, two ways, side by side: `httpx` (a plain
`httpx.AsyncClient`, what `extra_kwargs["http_client"]` was before: httpcore's connection pool) and
`mlrl` (`mlrl.workflow.agent_proxy.proxy.shared_http_client()`: openai's aiohttp-backed client).

    .venv/bin/python tools/bench_agent_http.py [--concurrency 32,128,256] [--repeats 2]

One sample: `concurrency` episodes of examples/calculator_agent.py at once (its `openai.AsyncOpenAI`
client on the given HTTP client; two model calls each: the tool call, then the answer), through
mlrl's recording proxy (`OpenAIProxy`, the tiny-llama-tools chat template and Hermes tool-call
parsing) to an engine that answers after `--engine-ms` with the calculator's tokens (a stand-in: the
client stack is what is measured, and a real engine's CPU would hide it on this machine's 2 cores).
Everything runs in this process's event loop, as in the launcher. Measured: CPU seconds of the
process and wall seconds per model call. The two ways alternate, --repeats times per concurrency.
Last line: `ratio httpx_over_mlrl_cpu_per_call: x` (the median over the concurrencies of httpx's
median / mlrl's; > 1: mlrl spends less CPU per call).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# mlrl, openai and the agent are imported where used: bad arguments are refused before those imports

MODEL = "builtin:tiny-llama-tools"
WAYS = ("httpx", "mlrl")


class CalculatorEngine:
    """Answers a question with a well-formed multiply call and a tool result with its number."""

    def __init__(self, tokenizer: Any, delay_s: float):
        self.tokenizer, self.delay_s = tokenizer, delay_s
        enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        self.call = enc('<tool_call>{"name":"multiply","arguments":{"a": 3 ,"b": 4 }}</tool_call>')
        self.answer = enc("12")
        self.calls = 0

    def get_version(self) -> int:
        return 0

    async def agenerate(self, req: Any) -> Any:
        from mlrl.types import ModelResponse, StopReason

        self.calls += 1
        await asyncio.sleep(self.delay_s)
        answered = "tool :" in self.tokenizer.decode(req.input_ids)
        out = (self.answer if answered else self.call) + [self.tokenizer.eos_token_id]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_logprobs=[-0.1] * len(out),
                             output_versions=[0] * len(out), stop_reason=StopReason.STOP, rid=req.rid)


async def sample(way: str, concurrency: int, proxy: Any, engine: CalculatorEngine) -> tuple[float, float]:
    """(CPU ms per model call, wall ms per model call) of `concurrency` episodes at once."""
    import httpx

    from examples.calculator_agent import CalculatorAgent
    from mlrl.workflow.agent_proxy.proxy import close_shared_http_client, shared_http_client

    if way == "httpx":  # what shared_http_client() built before
        http: Any = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                                      limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    else:
        http = shared_http_client()
    agent = CalculatorAgent()
    data = {"messages": [{"role": "user", "content": "multiply 3 4"}]}

    async def episode() -> None:
        s = proxy.start_session(engine, proxy.default_gconfig)
        try:
            await agent.run(data, base_url=s.base_url, api_key=s.api_key, http_client=http)
        finally:
            proxy.end_session(s.id)
        if len(s.log) != 2 or s.log.last is None or s.log.last.text != "12":
            raise SystemExit(f"bench_agent_http: an episode did not call the tool and answer ({way}): "
                             f"{[i.text for i in s.log]}")

    calls0 = engine.calls
    c0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(episode() for _ in range(concurrency)))
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    calls = engine.calls - calls0
    if way == "httpx":
        await http.aclose()
    else:
        await close_shared_http_client()
    return 1000 * cpu / calls, 1000 * wall / calls


async def run(concurrencies: list[int], repeats: int, engine_ms: float) -> None:
    from mlrl.data.tokenizer import load_hf_tokenizer
    from mlrl.types import GenerationHyperparameters
    from mlrl.workflow.agent_proxy.proxy import OpenAIProxy

    tokenizer = load_hf_tokenizer(MODEL)
    proxy = OpenAIProxy(tokenizer, default_gconfig=GenerationHyperparameters(max_new_tokens=32, temperature=1.0))
    await proxy.start()
    engine = CalculatorEngine(tokenizer, engine_ms / 1000)
    try:
        await sample("mlrl", 8, proxy, engine)  # warm-up: imports, the template's first render
        ratios = []
        for conc in concurrencies:
            got: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
            for _ in range(repeats):
                for way in WAYS:
                    got[way].append(await sample(way, conc, proxy, engine))
            med = {w: (statistics.median(c for c, _ in s), statistics.median(t for _, t in s)) for w, s in got.items()}
            for w in WAYS:
                cpus = ", ".join(f"{c:.2f}" for c, _ in got[w])
                print(f"{conc:>5} episodes {w:>6}: {med[w][0]:.2f} CPU ms / call ({cpus}), {med[w][1]:.2f} wall ms / "
                      f"call (median of {repeats}, {2 * conc} calls)", flush=True)
            ratios.append(med["httpx"][0] / med["mlrl"][0])
        print(f"ratio httpx_over_mlrl_cpu_per_call: {statistics.median(ratios):.2f}")
    finally:
        await proxy.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="32,128,256", help="episodes in flight, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engine-ms", type=float, default=20.0, help="the stand-in engine's answer time (default 20)")
    args = ap.parse_args()
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        concurrencies = []
    if not concurrencies or min(concurrencies) < 1:
        print(f"bench_agent_http: --concurrency must be positive integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"bench_agent_http: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.engine_ms < 0:
        print(f"bench_agent_http: --engine-ms must be >= 0, got {args.engine_ms}", file=sys.stderr)
        return 2
    asyncio.run(run(concurrencies, args.repeats, args.engine_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
