"""AdapterWeightSync (weight_sync.lora_mode=adapter) against a recording engine: the engine loads
exactly the PEFT folder the sync writes (peft itself reads it back), serves the adapter each
request names, and its canary logprobs are those of the trainer's adapted model. Across versions
the engine's logprobs move with the adapters, adapters two versions back are unloaded and their
folders removed, and a retried version reloads its rewritten folder."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers.one_engine_pool import OneEnginePool
from helpers.tools import load_tool
from peft import LoraConfig, PeftModel, get_peft_model

from mlrl.config.schema import LoRAConfig, WeightSyncConfig
from mlrl.modelzoo import resolve_model_dir
from mlrl.weight_sync import make_weight_sync
from mlrl.weight_sync.lora_adapter import AdapterWeightSync, adapter_name

HFWeightSource = load_tool("hf_weight_source").HFWeightSource  # shared with tools/bench_weight_sync.py

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def _base(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class RecordingClient:
    """One engine's control API: load / unload record the calls, prompt_logprobs runs the base
    model with the adapter the request names (`self.model`, as EngineClient sends it), loaded by
    peft from the folder the sync wrote."""

    def __init__(self, model_dir):
        self.model_dir, self.model = model_dir, None
        self.adapters: dict[str, PeftModel] = {}
        self.calls: list[tuple] = []
        self.version = 0
        self.fail_canary = 0  # canary answers to spoil (a retry)

    async def pause(self, mode="wait", **kw):
        self.calls.append(("pause",))

    async def resume(self):
        self.calls.append(("resume",))

    async def load_lora_adapter(self, name, path):
        self.calls.append(("load", name))
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        assert cfg["r"] == LORA.rank and cfg["lora_alpha"] == LORA.alpha
        self.adapters[name] = PeftModel.from_pretrained(_base(self.model_dir), path).eval()

    async def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        del self.adapters[name]

    async def set_weight_version(self, version):
        self.version = version

    async def reset_prefix_cache(self):
        return True

    @torch.no_grad()
    async def prompt_logprobs(self, ids):
        lp = torch.log_softmax(self.adapters[self.model](torch.tensor([ids])).logits[0].float(), -1)
        out = [0.0] + [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]
        if self.fail_canary:
            self.fail_canary -= 1
            out = [v + 1.0 for v in out]
        return out


@pytest.fixture
def setup(tmp_path):
    model_dir = resolve_model_dir("builtin:tiny-llama")
    torch.manual_seed(0)
    trainer = get_peft_model(_base(model_dir), LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                                          target_modules=list(LORA.target_modules)))
    client = RecordingClient(model_dir)
    pool = OneEnginePool(client)
    ws = make_weight_sync(WeightSyncConfig(transport="disk", lora_mode="adapter", canary_tolerance=1e-4), pool,
                          HFWeightSource(trainer), model_dir=model_dir, run_dir=tmp_path, lora=LORA)
    return trainer, client, pool, ws, tmp_path


def _move(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


PROBE = [1, 5, 6, 7, 8, 9, 10, 11]


async def test_adapter_versions_load_serve_and_unload(setup):
    trainer, client, pool, ws, tmp = setup
    assert isinstance(ws, AdapterWeightSync)
    served = {}
    for v in (1, 2, 3):
        _move(trainer, seed=v)  # the trainer's adapters change every step
        rep = await ws.sync(v)
        assert rep.version == v and rep.canary_max_abs_diff <= 1e-4 and client.model == adapter_name(v)
        # canary_moved: the engine's own canary logprobs against its previous check (none at v=1)
        assert (rep.canary_moved is None) == (v == 1) and dict(rep).get("weight_sync/canary_moved", 1.0) > 1e-2
        assert client.version == v and pool.version == v
        served[v] = await client.prompt_logprobs(PROBE)
        with torch.no_grad():  # the engine serves the trainer's adapted model
            want = torch.log_softmax(trainer(torch.tensor([PROBE])).logits[0].float(), -1)
        assert max(abs(served[v][i] - float(want[i - 1, t])) for i, t in enumerate(PROBE) if i) <= 1e-5
    # the engine moved with the adapters, by far more than the canary tolerance
    assert max(abs(a - b) for a, b in zip(served[1], served[2])) > 1e-2
    assert [c for c in client.calls if c[0] in ("load", "unload")] == [
        ("load", "mlrl-lora-v1"), ("load", "mlrl-lora-v2"), ("load", "mlrl-lora-v3"), ("unload", "mlrl-lora-v1")]
    assert sorted(client.adapters) == ["mlrl-lora-v2", "mlrl-lora-v3"]  # KEEP_LOADED: the previous one stays
    assert sorted(p.name for p in (tmp / "weight_sync").iterdir()) == ["v00000002", "v00000003"]


async def test_a_retried_version_reloads_its_rewritten_folder(setup):
    trainer, client, pool, ws, _ = setup
    _move(trainer, seed=1)
    client.fail_canary = 1  # the first canary answer is off: the sync retries once
    rep = await ws.sync(1)
    assert rep.attempts == 2 and client.model == adapter_name(1)
    assert [c for c in client.calls if c[0] in ("load", "unload")] == [
        ("load", "mlrl-lora-v1"), ("unload", "mlrl-lora-v1"), ("load", "mlrl-lora-v1")]
