"""GPU transports of the weight sync (skipped without CUDA): NCCL broadcast and CUDA IPC into a
real vLLM engine colocated with an HF "trainer" on GPU 0. Written against the real APIs; not
exercised on the CPU development machines."""

import asyncio

import pytest
import torch
from helpers.tools import load_tool

from mlrl.config.schema import RolloutConfig, WeightSyncConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool
from mlrl.weight_sync import make_weight_sync
from mlrl.weight_sync.sender import push_from_rank
from mlrl.weight_sync.source import PushRequest

HFWeightSource = load_tool("hf_weight_source").HFWeightSource  # shared with tools/bench_weight_sync.py

pytestmark = pytest.mark.timeout(900)


def _perturb(model, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))


# The importing side of the round trip, in its own process as in a real engine: CUDA refuses to open
# an IPC handle in the process that exported it (an H200 run of the in-process version of this test:
# "CUDA error: invalid device context" in cudaIpcOpenMemHandle).
_RECEIVER = """
import json, sys, torch
from mlrl.weight_sync.transports import receive_ipc
got = {}
streams = receive_ipc(json.loads(sys.stdin.read()), lambda b: got.update(dict(b)), torch.device("cuda", 0))
w = got["w"]
print(json.dumps({"digest": streams[0]["digest"], "values": w.cpu().tolist(), "ptr_device": str(w.device)}))
w.add_(1.0)  # written through the mapping: the exporter sees it
torch.cuda.synchronize()
"""


def test_ipc_handles_round_trip_through_another_process():
    import json
    import subprocess
    import sys

    t = torch.randn(1000, device="cuda")
    want = t.cpu().tolist()
    rep = push_from_rank(PushRequest("cuda_ipc", 1), lambda n: iter([[("w", t)]]), 0)
    try:
        out = subprocess.run([sys.executable, "-c", _RECEIVER], input=json.dumps([rep.ipc]), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        # the receiver read the exporter's memory (same values, same checksum digest) and wrote into it
        assert got["values"] == want and got["digest"] == rep.digest and got["ptr_device"] == "cuda:0"
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.tensor(want) + 1.0)
    finally:
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
