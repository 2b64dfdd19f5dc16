"""`AdapterWeightSync` (weight_sync.lora_mode=adapter): only the LoRA adapters travel; the engines
serve them through vLLM's own LoRA support.

The engines are started with `--enable-lora` (mlrl.rollout.server, `ServerSpec.lora_rank`). One
sync of version v, inside the usual `WeightSync.sync` (pause, verify, canary, commit, resume):
    trainer ranks   each pipeline stage's sender writes its adapters (peft names, checksummed
                    safetensors shards + a `.done` record) under <disk_dir>/v<v>/parts: the disk
                    transport's send, with `PushRequest.content="adapters"`
    driver          reads every sender's shards back, checking each tensor's checksum and each
                    sender's digest, and writes ONE PEFT folder <disk_dir>/v<v>/adapter
                    (adapter_config.json + adapter_model.safetensors: what vLLM and peft load)
    engines         `POST /v1/load_lora_adapter {lora_name: "mlrl-lora-v<v>", lora_path}`; the
                    engine's weight version becomes v; its client names the new adapter in every
                    request from then on (`EngineClient.model`); the adapter two versions back is
                    unloaded (the one before stays: requests that ran on it may still finish)
The worker reports that `verify_reports` compares with the senders' are the driver's read-back of
the shards (the engines load the folder themselves: there is no worker-side stream to count);
that the engines serve exactly the trainer's adapter is what the canary checks, with the request
naming the new adapter.

Versioned adapter names in versioned folders, never `load_inplace` (see EngineClient.load_lora_adapter:
measured on vLLM 0.32, an in-place load is re-read from disk every engine step and switches running
requests mid-sequence): a request is served by exactly the adapter it names, and vLLM keys
prefix-cache blocks by adapter, so no KV computed under an older adapter is reused. Loading takes
7-12 ms (tiny Llama) and 60-160 ms (SmolLM2-135M, rank 16) on CPU. vLLM's CPU LoRA kernels make
generation ~3x and prefill ~6x slower than the base model on SmolLM2 (measured): on CPU, merged
mode serves faster; adapter mode is for GPUs and for large models where the sync dominates.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, Protocol, Sequence, cast

from mlrl.ckpt_files.peft_adapter import write_peft_adapter
from mlrl.config.schema import LoRAConfig, WeightSyncConfig
from mlrl.interfaces import EngineControl, EngineHandle, RolloutPool
from mlrl.weight_sync.source import PushRequest, WeightSource
from mlrl.weight_sync.sync import SyncSetup, engine_client, gather_all
from mlrl.weight_sync.transports import DiskWeightSync, _check_senders, receive_disk

ADAPTER_PREFIX = "mlrl-lora"
KEEP_LOADED = 2  # adapters an engine holds: the engines' --max-loras (mlrl.rollout.server.MAX_LORAS)


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}-v{version}"


class _LoRAControl(EngineControl, Protocol):
    """What this sync uses of an engine's client (mlrl.rollout.client.EngineClient) beyond `EngineControl`."""

    model: str | None  # the served model every request names

    async def load_lora_adapter(self, name: str, path: str) -> None: ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    async def set_weight_version(self, version: int) -> None: ...


def _lora_client(e: EngineHandle) -> _LoRAControl:
    return cast(_LoRAControl, engine_client(e))


class AdapterWeightSync(DiskWeightSync):
    """LoRA adapters as PEFT folders loaded by vLLM (see the module docstring)."""

    transport = "disk"

    def __init__(self, cfg: WeightSyncConfig, pool: RolloutPool, source: WeightSource, setup: SyncSetup, *,
                 lora: LoRAConfig) -> None:
        super().__init__(cfg, pool, source, setup)
        self.lora = lora
        self.loaded: dict[tuple[str, int], list[str]] = {}  # (engine, incarnation) -> adapters it holds, oldest first

    async def _transfer(self, version: int, engines: Sequence[EngineHandle]):
        out = self.root / f"v{version:08d}"
        if out.exists():
            shutil.rmtree(out)  # a retry or a re-sync of the same version starts from a clean folder
        parts = out / "parts"
        req = PushRequest(self.transport, version, self.bucket_bytes, self.cfg.verify_checksums,
                          disk_dir=str(parts), content="adapters")
        senders = _check_senders(await self._push(req), self.source.num_senders)
        folder, streams = await asyncio.to_thread(self._assemble, parts, out / "adapter")
        name = adapter_name(version)

        async def load(e: EngineHandle) -> list[dict[str, Any]]:
            held = self.loaded.setdefault((e.name, e.incarnation), [])  # a restarted engine holds none
            if name in held:  # a retry of this version: its folder was rewritten, load it afresh
                await _lora_client(e).unload_lora_adapter(name)
                held.remove(name)
            await _lora_client(e).load_lora_adapter(name, str(folder))
            held.append(name)
            await _lora_client(e).set_weight_version(version)
            _lora_client(e).model = name
            while len(held) > KEEP_LOADED:
                await _lora_client(e).unload_lora_adapter(held.pop(0))
            return [{"version": version, "worker": "driver", "streams": streams}]

        reports = list(await gather_all(load(e) for e in engines))  # every load ends before a failure is raised
        for old in self.root.glob("v*"):
            if old != out and old.is_dir() and old.name < f"v{version - 1:08d}":
                shutil.rmtree(old, ignore_errors=True)  # the previous version's folder stays while it is loaded
        return senders, reports

    def _assemble(self, parts: Path, folder: Path) -> tuple[Path, list[dict[str, Any]]]:
        tensors: dict[str, Any] = {}

        def apply(bucket):
            tensors.update(bucket)

        streams = receive_disk(parts, self.source.num_senders, apply, verify=self.cfg.verify_checksums)
        return write_peft_adapter(folder, tensors, self.lora, base_model=str(self.setup.model_dir)), streams
