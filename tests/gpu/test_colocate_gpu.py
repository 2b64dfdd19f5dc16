"""Colocated placement on GPU (skipped without CUDA): vLLM sleep mode really releases device memory,
the trainer's offload really releases its memory, and a colocated run syncs through CUDA IPC.
Written against the real APIs (vLLM `--enable-sleep-mode`, `/sleep`, `/wake_up?tags=`,
torch.cuda.mem_get_info); not exercised on the CPU development machines."""

import asyncio
import re

import pytest
import torch
from helpers.launching import launch, metrics

from mlrl.config.schema import RolloutConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool

pytestmark = pytest.mark.timeout(900)
GiB = 1 << 30


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def _kv_cache_bytes(log: str) -> int:
    m = re.search(r"Available KV cache memory: ([\d.]+) GiB", log)
    assert m, "vLLM's log did not report its KV cache size"
    return int(float(m.group(1)) * GiB)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_at_least_the_kv_cache(level, tmp_path):
    async def main():
        model_dir = resolve_model_dir("builtin:smollm2-135m-instruct")
        cfg = RolloutConfig(num_engines=1, max_model_len=512, gpu_memory_utilization=0.4, enforce_eager=True)
        async with EnginePool(cfg, model_dir, run_dir=tmp_path, cuda_devices=[[0]], sleep_mode=True) as pool:
            client = pool.live_engines()[0].client
            kv = _kv_cache_bytes((tmp_path / "engines" / "engine-0.log").read_text())
            awake = _free()
            await client.sleep(level)
            assert await client.is_sleeping()
            asleep = _free()
            released = asleep - awake
            want = kv + (int(0.2 * GiB) if level == 2 else 0)  # level 2 also discards the ~270 MB of weights
            assert released >= want, (level, released / GiB, kv / GiB)
            assert not await client.wake_up(["weights"])   # weights first: not fully awake yet
            assert await client.wake_up(["kv_cache"])     # then the KV cache: awake, scheduling again
            assert not await client.is_sleeping()
            assert _free() <= asleep - kv
            if level == 1:  # level 1 kept the weights in host memory: the engine serves the same model
                lp = await client.prompt_logprobs(list(range(100, 132)))
                assert all(x <= 0 for x in lp[1:])

    asyncio.run(main())


def test_trainer_offload_releases_device_memory_and_a_colocated_run_syncs_by_ipc(tmp_path):
    """The demo on one GPU, colocated, CUDA IPC weight sync: the engine's memory is released
    (colocate/engine_memory_released=1), the canary passes after every wake, and the trainer's
    offload reports the bytes it released."""
    run = tmp_path / "run"
    launch(run, "--config", "launch/cpu_default.yaml", "cluster.gpus_per_node=1", "cluster.placement=colocated",
           "cluster.colocate.offload_params=true", "weight_sync.transport=cuda_ipc",
           "rollout.gpu_memory_utilization=0.3", "trainer.total_steps=3", "logging.progress_bar=false")
    for r in metrics(run):
        assert r["colocate/engine_memory_released"] == 1.0
        assert r["weight_sync/canary_max_abs_diff"] <= 1e-3
        assert r["colocate/offload_bytes/params"] > 0 and r["colocate/offload_bytes/grads"] > 0
        for phase in ("sleep", "wake", "offload", "reload"):
            assert r[f"timing/{phase}"] > 0.0
