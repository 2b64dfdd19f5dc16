"""The CPU capture of routed experts in a real vLLM server (worker extension, mlrl.rollout.routing)
against Hugging Face transformers' own routing of the same sequences: every computed position and
MoE layer gets the experts HF's router picks, for n > 1 requests and for samples whose prompt hit
vLLM's prefix cache (a 200-token prompt spans a complete 128-token KV block)."""

import asyncio

import numpy as np
import pytest
import torch

from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout.client import EngineClient
from mlrl.rollout.server import EngineServer, ServerSpec
from mlrl.types import GenerationHyperparameters

pytestmark = pytest.mark.timeout(600)


def test_captured_routes_equal_hf_routes_with_prefix_cache_hits(tmp_path):
    import transformers

    model_dir = resolve_model_dir("builtin:tiny-qwen3-moe")
    server = EngineServer(ServerSpec(name="e0", model_dir=str(model_dir), dtype="float32", token="tok",
                                     log_path=str(tmp_path / "engine.log")))
    prompt = [(i * 7) % 60 + 5 for i in range(200)]

    async def main():
        c = EngineClient(server.url, "tok", name="e0")
        try:
            info = await c.routing_enable()
            g = GenerationHyperparameters(max_new_tokens=10, temperature=1.0, seed=3)
            first = await c.generate_n(prompt, g, 2, request_id="a", default_version=0)
            again = await c.generate_n(prompt, g.new(seed=9), 3, request_id="b", default_version=0)
            seqs = [prompt + s.tokens for s in first + again]
            rows = await c.routing_take(seqs)
            stats = (await c.collective_rpc("mlrl_routing_take", args=["[]"]))[0]["stats"]
            return info, seqs, rows, stats
        finally:
            await c.aclose()

    server.start()
    try:
        server.wait_ready(300)
        info, seqs, rows, stats = asyncio.run(main())
    finally:
        server.stop()
    assert info == {"layers": 2, "experts": 4, "top_k": 2, "block_size": 128, "dtype": "uint8"}
    assert stats["prefix_hits"] >= 1 and "prefix_missing" not in stats, stats
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for seq, got in zip(seqs, rows):
        assert got is not None and got.shape == (len(seq) - 1, 2, 2) and got.dtype == np.uint8
        with torch.no_grad():
            logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        want = np.stack([torch.topk(r, 2, dim=-1).indices.numpy() for r in logits], axis=1)[: len(seq) - 1]
        np.testing.assert_array_equal(np.sort(got.astype(np.int64), -1), np.sort(want, -1))
