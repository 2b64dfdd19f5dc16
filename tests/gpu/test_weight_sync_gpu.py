"""GPU transports of the weight sync (skipped without CUDA): NCCL broadcast and CUDA IPC into a
real vLLM engine colocated with an HF "trainer" on GPU 0. Written against the real APIs; not
exercised on the CPU development machines."""

import asyncio

import pytest
import torch

from mlrl.config.schema import RolloutConfig, WeightSyncConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool
from mlrl.weight_sync import HFWeightSource, make_weight_sync
from mlrl.weight_sync.sender import push_from_rank
from mlrl.weight_sync.source import PushRequest
from mlrl.weight_sync.transports import receive_ipc

pytestmark = pytest.mark.timeout(900)


def _perturb(model, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))


def test_ipc_handles_round_trip_in_process():
    t = torch.randn(1000, device="cuda")
    rep = push_from_rank(PushRequest("cuda_ipc", 1), lambda n: iter([[("w", t)]]), 0)
    got = {}
    # rebuilding in the exporting process maps the same memory
    streams = receive_ipc([rep.ipc], lambda b: got.update(dict(b)), torch.device("cuda", 0))
    assert torch.equal(got["w"], t) and streams[0]["digest"] == rep.digest
    push_from_rank(PushRequest("cuda_ipc", 1, phase="release"), lambda n: iter(()), 0)


@pytest.mark.parametrize("transport", ["broadcast", "cuda_ipc"])
def test_gpu_transport_makes_the_engine_the_new_model(transport, tmp_path):
    # NCCL refuses two ranks of one communicator on the same GPU: the broadcast engine gets GPU 1
    if transport == "broadcast" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL broadcast needs the engine on another GPU than the trainer (2 GPUs)")
    engine_gpu = 1 if transport == "broadcast" else 0

    async def main():
        model_dir = resolve_model_dir("builtin:smollm2-135m-instruct")
        src = HFWeightSource.from_pretrained(model_dir)
        src.model.to("cuda")
        cfg = RolloutConfig(num_engines=1, max_model_len=512, gpu_memory_utilization=0.5, enforce_eager=True)
        async with EnginePool(cfg, model_dir, run_dir=tmp_path, cuda_devices=[[engine_gpu]]) as pool:
            ws = make_weight_sync(
                WeightSyncConfig(transport=transport, canary_tolerance=2e-3),
                pool,
                src,
                model_dir=model_dir,
                engine_tp=cfg.engine_tp,
                host=cfg.host,
                run_dir=tmp_path,
            )
            old = await pool.engines[0].client.prompt_logprobs(list(range(1, 20)))
            _perturb(src.model, 1)
            rep = await ws.sync(1)
            assert rep.attempts == 1 and rep.canary_max_abs_diff <= 2e-3
            new = await pool.engines[0].client.prompt_logprobs(list(range(1, 20)))
            assert max(abs(a - b) for a, b in zip(old, new)) > 1e-2
            await ws.close()

    asyncio.run(main())
