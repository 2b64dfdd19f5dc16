"""Colocated placement on GPU (skipped without CUDA): vLLM sleep mode really releases device memory
and wakes up serving the same model, the trainer's offload really releases its memory (as the
device's allocator measures it), and a colocated run syncs through CUDA IPC.
Written against the real APIs (vLLM `--enable-sleep-mode`, `/sleep`, `/wake_up?tags=`,
torch.cuda.mem_get_info); not exercised on the CPU development machines."""

import asyncio
import re

import pytest
import torch
from helpers.launching import launch, metrics
from helpers.tools import load_tool

from mlrl.config.schema import RolloutConfig, WeightSyncConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout import EnginePool
from mlrl.weight_sync import make_weight_sync

HFWeightSource = load_tool("hf_weight_source").HFWeightSource  # shared with tools/bench_weight_sync.py

pytestmark = pytest.mark.timeout(900)
GiB = 1 << 30
MiB = 1 << 20


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def _logged_gib(log: str, pattern: str) -> int:
    m = re.search(pattern, log)
    assert m, f"vLLM's log has no line matching {pattern!r}"
    return int(float(m.group(1)) * GiB)


class _WakeAroundTransfer:
    """The SyncHooks of mlrl.colocation at sleep level 2: the weights' memory comes back before the
    transfer writes it, the KV cache after."""

    def __init__(self, client):
        self.client = client

    async def before_transfer(self) -> None:
        assert not await self.client.wake_up(["weights"])  # weights first: not fully awake yet

    async def before_verify(self) -> None:
        assert await self.client.wake_up(["kv_cache"])     # then the KV cache: awake, scheduling again


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_weights_and_kv_cache_and_wakes_to_the_same_model(level, tmp_path):
    async def main():
        model_dir = resolve_model_dir("builtin:smollm2-135m-instruct")
        # level 2 discards the weights: mlrl's sync rewrites them after the wake, here from an HF
        # copy of the same folder (on the GPU before the first measurement, so that it is in both)
        src = HFWeightSource.from_pretrained(model_dir) if level == 2 else None
        if src is not None:
            src.model.to("cuda")
        cfg = RolloutConfig(num_engines=1, max_model_len=512, gpu_memory_utilization=0.4, enforce_eager=True)
        async with EnginePool(cfg, model_dir, run_dir=tmp_path, cuda_devices=[[0]], sleep_mode=True) as pool:
            client = pool.live_engines()[0].client
            log = (tmp_path / "engines" / "engine-0.log").read_text()
            kv = _logged_gib(log, r"Available KV cache memory: ([\d.]+) GiB")
            weights = _logged_gib(log, r"Model loading took ([\d.]+) GiB memory")
            prompt = list(range(100, 132))
            before = await client.prompt_logprobs(prompt)
            # the engine repeats itself on this request: the equality after the wake is about sleep / wake
            assert await client.prompt_logprobs(prompt) == before
            awake = _free()
            await client.sleep(level)
            assert await client.is_sleeping()
            asleep = _free()
            # Both levels unmap every allocation of vLLM's CuMemAllocator (level 1 copies the weights
            # to host memory first, level 2 drops them): the KV cache and the weights both leave the
            # device. The two logged sizes are rounded to 0.01 GiB and the KV cache is allocated in
            # whole blocks, hence the margin.
            want = kv + weights - 32 * MiB
            assert asleep - awake >= want, (level, (asleep - awake) / GiB, kv / GiB, weights / GiB)
            if level == 1:
                assert not await client.wake_up(["weights"])  # weights first: not fully awake yet
                assert await client.wake_up(["kv_cache"])     # then the KV cache: awake, scheduling again
            else:
                ws = make_weight_sync(WeightSyncConfig(transport="cuda_ipc", canary_tolerance=0.0), pool, src,
                                      model_dir=model_dir, engine_tp=cfg.engine_tp, host=cfg.host, run_dir=tmp_path)
                # the sync's own checks: every engine parameter received a tensor, checksums equal
                await ws.sync(1, hooks=_WakeAroundTransfer(client))
                await ws.close()
            assert not await client.is_sleeping()
            assert asleep - _free() >= want  # both came back
            after = await client.prompt_logprobs(prompt)
            # Level 1 restores the weights byte for byte from host memory (level 2: the sync writes the
            # same fp32 HF tensors through the same weight loaders as the start-up load, and vLLM
            # restores its buffers, e.g. the RoPE cache, itself). Same bytes, same engine, the same
            # single request, so the same kernels: the logprobs are bit-identical, not merely close
            # (prompt logprobs never read the prefix cache, and the KV cache is rewritten by the prefill).
            # A tolerance would hide a partial restore (one norm or bias left at its woken garbage).
            assert after == before, max(abs(a - b) for a, b in zip(after, before))

    asyncio.run(main())


def test_trainer_offload_releases_device_memory_and_a_colocated_run_syncs_by_ipc(tmp_path):
    """The demo on one GPU, colocated, CUDA IPC weight sync: the engine's memory is released
    (colocate/engine_memory_released=1), the trainer's offload frees on the device what it reports,
    and after every wake the engine holds the trainer's new weights."""
    run = tmp_path / "run"
    launch(run, "--config", "launch/cpu_default.yaml", "cluster.gpus_per_node=1", "cluster.placement=colocated",
           "cluster.colocate.offload_params=true", "weight_sync.transport=cuda_ipc",
           "rollout.gpu_memory_utilization=0.3", "trainer.total_steps=3", "logging.progress_bar=false")
    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["colocate/engine_memory_released"] == 1.0
        reported = sum(r[f"colocate/offload_bytes/{k}"] for k in ("params", "grads", "optimizer"))
        assert r["colocate/offload_bytes/params"] > 0 and r["colocate/offload_bytes/grads"] > 0
        assert r["colocate/offload_bytes/optimizer"] > 0  # the optimizer state exists once a step has trained
        # The offloader's byte counts are its own sums of storage sizes; colocate/offload_measured_bytes
        # is torch.cuda.memory_allocated before minus after the storages were released, on the rank's
        # device (mlrl.trainer.rank.offload). Each freed storage returns a whole allocator block (its
        # size rounded up to 512 bytes), so a working offload measures at least what it reports; 80%
        # leaves room for a storage the allocator did not hand out and so cannot account for. A
        # storage that is counted but stays allocated (still referenced, on the wrong device, never
        # resized) shows up here, not in the reported bytes.
        assert r["colocate/offload_measured_bytes"] >= 0.8 * reported, (r["colocate/offload_measured_bytes"], reported)
        for phase in ("sleep", "wake", "offload", "reload"):
            assert r[f"timing/{phase}"] > 0.0
        # The canary after each wake: the engine's logprobs of a fixed sequence equal the trainer's.
        assert r["weight_sync/canary_max_abs_diff"] <= 1e-3
        # On-policy (colocated runs are synchronous): the engine that sampled this step's tokens held
        # the trainer's weights, token for token, not only on the canary's sequence.
        assert r["train/mismatch/logprob_gap"] <= 1e-3, r["train/mismatch/logprob_gap"]
    # The weights really moved between steps: the KL to the frozen reference (the step-1 weights) is
    # 0 at step 1 and grows once the policy has been updated (about 0.1 at step 2 on CPU). With the
    # small gap above, the engine's logprobs moved with the trainer's: a sync that left the engine on
    # the old weights would fail the gap, one that wrote nothing new would leave the KL at 0.
    assert all(r["train/kl"] > 1e-3 for r in recs[1:]), [r["train/kl"] for r in recs]
