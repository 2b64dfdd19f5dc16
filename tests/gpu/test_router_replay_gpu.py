"""MoE router replay on GPU (skipped without CUDA): vLLM's own capture (`--enable-return-routed-
experts`, Model Runner V2) returns the experts of every computed position with each answer, the
pool hands them to the loop, and a run replays them. Written against the real APIs; not exercised
on the CPU development machines (vLLM's CPU build needs Triton for Model Runner V2 and uses the
worker-extension capture instead, tests/integration/loop/test_router_replay.py)."""

import asyncio

import numpy as np
import pytest
import torch
from helpers.launching import launch, metrics

from mlrl.config.schema import RolloutConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool
from mlrl.types import GenerationHyperparameters, ModelRequest

pytestmark = pytest.mark.timeout(900)


def test_vllm_returns_the_routes_hf_would_take(tmp_path):
    import transformers

    model_dir = resolve_model_dir("builtin:tiny-qwen3-moe")

    async def main():
        cfg = RolloutConfig(num_engines=1, gpu_memory_utilization=0.3)
        async with EnginePool(cfg, model_dir, run_dir=tmp_path, cuda_devices=[[0]], capture_routing=True) as pool:
            prompt = list(range(5, 45))
            resp = await pool.agenerate(ModelRequest(prompt, GenerationHyperparameters(max_new_tokens=8, seed=1)))
            seq = prompt + resp.output_tokens
            return seq, (await pool.fetch_routing([seq]))[0]

    seq, rows = asyncio.run(main())
    assert rows is not None and rows.shape[0] == len(seq) - 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
    k = rows.shape[-1]
    want = np.stack([torch.topk(r.float(), k, dim=-1).indices.cpu().numpy() for r in logits], axis=1)[: len(seq) - 1]
    agree = (np.sort(rows.astype(np.int64), -1) == np.sort(want, -1)).all(-1).mean()
    assert agree >= 0.99, agree


def test_router_replay_run_on_gpu(tmp_path):
    run = tmp_path / "run"
    launch(run, "--config", "launch/cpu_default.yaml", "cluster.gpus_per_node=2", "model.hf_dir=builtin:tiny-qwen3-moe",
           "algorithm.router_replay=true", "trainer.total_steps=2", "rollout.gpu_memory_utilization=0.3",
           "logging.progress_bar=false")
    recs = metrics(run)
    assert all(r["samples/routing_missing"] == 0.0 for r in recs)
    assert recs[0]["mismatch/router_agreement"] >= 0.99
