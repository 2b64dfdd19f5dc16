"""`model.init_from` end to end: RL starts from an SFT run's checkpoint.

One SFT run (`launch/sft_cpu.yaml`, TP1, 4 steps, checkpoint + HF export at the end) is shared by
the module. Then, on the demo recipe (1 RL step, 4 prompts x 4 samples, the same seeds):
  A  model.init_from=<the SFT checkpoint>
  B  model.hf_dir=<the SFT run's HF export>  (the way to start RL from SFT without init_from)
A's trainer must start from the SFT weights: its step-1 metrics equal B's bit for bit (rollouts,
old logprobs, entropy, loss, gradient norm: all computed from the initial weights), and its HF
export after the step equals B's bit for bit (same start, same fresh optimizer and LR warm-up).
Both fail if init_from were ignored (A would train tiny-llama's random weights). The weight sync's
canary passes (the engines got the trainer's weights) and the KL to the reference is 0 at step 1
(the reference started from init_from too, not from model.hf_dir).

Then this file, run as a torchrun script on 2 ranks (TP2), loads the TP1 checkpoint into a
trainable policy, a frozen reference policy and a LoRA policy, and the HF export into a policy:
every HF tensor each exports equals the SFT export bit for bit, and the LoRA adapters are the
fresh ones of a LoRA policy built from model.hf_dir.

Cost on 2 cores: SFT ~35 s; the two RL runs ~100 s together (concurrent: each alone ~80 s, mostly
its vLLM engine starting); TP2 ~20 s. The module ~2.6 min.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS))                            # helpers (also when torchrun runs this file)
sys.path.insert(0, str(TESTS / "integration" / "trainer"))  # trainer_harness
from helpers.launching import launch, metrics  # noqa: E402

SFT = ["--config", "launch/sft_cpu.yaml", "logging.progress_bar=false", "sft.batch_size=32", "data.num_synthetic=128",
       "data.eval=null", "trainer.total_steps=4", "trainer.lr_warmup_steps=1", "trainer.lr=5e-3"]
RL = ["--config", "launch/cpu_default.yaml", "logging.progress_bar=false", "trainer.total_steps=1",
      "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "checkpoint.save_at_end=true",
      "checkpoint.hf_export_at_end=true", "rollout.startup_timeout_s=600"]
# step-1 metrics that depend on the initial weights (rollout on the engines, recomputation on the trainer)
SAME = ("reward/mean", "advantages/abs_mean", "train/entropy", "train/loss", "train/pg_loss", "train/grad_norm",
        "train/kl", "train/lr", "train/mismatch/logprob_gap", "weight_sync/canary_max_abs_diff")


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("init_from") / "sft"
    launch(run, *SFT)
    return run


@pytest.fixture(scope="module")
def rl(sft) -> dict:
    root = sft.parent
    ckpt, export = sft / "checkpoints" / "step_000004", sft / "hf" / "step_000004"
    with ThreadPoolExecutor(2) as pool:  # concurrently: each run mostly waits for its engine to start
        a = pool.submit(launch, root / "a", *RL, f"model.init_from={ckpt}")
        b = pool.submit(launch, root / "b", *RL, f"model.hf_dir={export}")
        a, _ = a.result(), b.result()
    return {"a": root / "a", "b": root / "b", "a_log": a.stderr, "ckpt": ckpt}


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_rl_starts_from_the_sft_checkpoint(rl):
    assert f"starts from the weights of SFT checkpoint (step 4) {rl['ckpt']}" in rl["a_log"]
    (a,), (b,) = metrics(rl["a"]), metrics(rl["b"])
    assert a["weight_sync/canary_max_abs_diff"] <= 1e-3 and a["train/mismatch/logprob_gap"] <= 1e-3, a
    assert a["train/kl"] == 0.0, a  # the KL reference = the initial policy = the SFT weights
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}


def test_weights_after_the_step_equal_the_hf_dir_run(rl, sft):
    import torch

    from mlrl.modelzoo import resolve_model_dir

    a, b = _tensors(rl["a"] / "hf" / "step_000001"), _tensors(rl["b"] / "hf" / "step_000001")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    base, tuned = _tensors(resolve_model_dir("builtin:tiny-llama")), _tensors(sft / "hf" / "step_000004")
    name = "model.embed_tokens.weight"
    assert (tuned[name] - base[name]).abs().max() > 1e-3  # the SFT moved the weights: the comparison means something
    # weights only: a fresh optimizer (1 step, not the SFT's 4 + 1), and the run records where it started
    meta = json.loads((rl["a"] / "checkpoints" / "step_000001" / "model_optim" / "mlrl_checkpoint.json").read_text())
    assert meta["optimizer"]["steps"] == 1 and meta["init_from"] == str(rl["ckpt"])


# ---- TP2: the TP1 checkpoint (and the HF export) into policies of another layout --------------------------
def test_tp1_checkpoint_loads_into_tp2_policy_reference_and_lora(sft):
    from trainer_harness import run_torchrun

    ranks, _ = run_torchrun(Path(__file__), ["--sft", str(sft)], 2, timeout=300)
    for r in ranks:
        assert "error" not in r, r.get("error")
    sender = ranks[0]  # tp 0 exports the gathered tensors
    for case in ("policy<-checkpoint", "reference<-checkpoint", "lora<-checkpoint", "policy<-hf"):
        assert sender[case]["mismatched"] == [] and sender[case]["compared"] == sender["hf_tensors"] > 0, case
    assert sender["lora_adapters_fresh"] and sender["lora_adapters"] > 0
    assert sender["lora_base_hf_dir"] is None  # its base is a checkpoint, not an HF folder: convert needs --base
    assert ranks[1]["policy<-checkpoint"]["compared"] == 0  # tp 1 sends nothing


def _worker(sft: Path) -> dict:
    import torch

    from mlrl.bridge import HFCheckpoint
    from mlrl.config.schema import Config, LoRAConfig
    from mlrl.config.validate import resolve_layout
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.trainer.rank.dist_ckpt import _base_hf_dir, init_weights_from
    from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

    ckpt, export = sft / "checkpoints" / "step_000004", sft / "hf" / "step_000004"
    hf = HFCheckpoint(export)
    want = hf.read(list(hf.tensors))

    def policy(trainable=True, lora=False):
        cfg = Config()
        cfg.parallel.tp, cfg.cluster.trainer_devices = 2, 2
        cfg.model.lora = LoRAConfig(rank=4, alpha=8.0) if lora else None
        layout = resolve_layout(cfg)
        init_parallel(cfg.parallel, layout, seed=cfg.trainer.seed)
        return MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, trainable=trainable,
                              hf_dir=resolve_model_dir(cfg.model.hf_dir))

    def compare(pol) -> dict:
        got = {n: t for b in pol.iter_hf_buckets(1 << 30) for n, t in b}
        return {"compared": len(got), "mismatched": [n for n, t in got.items() if not torch.equal(t, want[n])]}

    out: dict = {"hf_tensors": len(want)}
    cases = (("policy<-checkpoint", True, False, ckpt), ("reference<-checkpoint", False, False, ckpt),
             ("lora<-checkpoint", True, True, ckpt), ("policy<-hf", True, False, export))
    for case, trainable, lora, src in cases:
        pol = policy(trainable, lora)
        init_weights_from(pol, str(src))
        out[case] = compare(pol)  # with LoRA: the merged weights, B = 0 at the start, i.e. the base
        if lora:
            fresh = dict(policy(True, True).iter_adapters())
            adapters = dict(pol.iter_adapters())
            out["lora_adapters"] = len(adapters)
            out["lora_adapters_fresh"] = adapters.keys() == fresh.keys() and all(
                torch.equal(adapters[n], fresh[n]) for n in adapters)
            out["lora_base_hf_dir"] = _base_hf_dir(pol)
    return out


if __name__ == "__main__":  # torchrun: python -m torch.distributed.run --nproc-per-node 2 test_rl_from_sft.py
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sft", required=True)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = _worker(Path(args.sft))
    except Exception:
        result = {"error": traceback.format_exc()}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
