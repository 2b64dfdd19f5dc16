"""torchrun worker for test_offload.py: trainer offload / reload (colocated placement) on gloo ranks.

For each layout (`--layouts ref,tp2,bf16`: dp2 with Megatron's distributed Adam, tp2 with plain
Adam, dp2 in bf16 with fp32 master weights), in ONE launch:
- a policy (+ frozen KL reference + critic) trains one step; its parameters, optimizer state and the
  reference's parameters are snapshotted byte for byte;
- offload(params, grads, optimizer) releases every storage of each kind (sizes reported), reload
  brings back the same bytes;
- the next step of the offloaded policy equals (loss, grad norm, every parameter bit for bit) the
  same step of a twin that was never offloaded;
- with only optimizer + grads offloaded the parameters stay usable: the HF export stream is the
  same bytes as before.
Each rank writes `<out>/rank<r>.json`; assertions live in test_offload.py.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from critic_worker import Phase
from hf_reference import make_step, pg_loss
from trainer_worker import build_cfg

LR = 1e-2


def snapshot(models) -> dict[str, bytes]:
    """Every parameter and optimizer tensor of `models`, as bytes, keyed by position."""
    from mlrl.trainer.rank.offload import model_tensors

    out = {}
    for i, m in enumerate(models):
        mt = model_tensors(m)
        for kind in ("params", "optimizer"):
            for j, t in enumerate(mt[kind]):
                out[f"{i}/{kind}/{j}"] = t.detach().cpu().reshape(-1).view(torch.uint8).clone().numpy().tobytes()
    return out


def resident_bytes(models, kind: str) -> int:
    from mlrl.trainer.rank.offload import model_tensors

    seen, total = set(), 0
    for m in models:
        for t in model_tensors(m)[kind]:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def hf_stream(p) -> dict[str, bytes]:
    return {n: t.detach().cpu().reshape(-1).view(torch.uint8).clone().numpy().tobytes() for n, t in p.params.iter_hf()}


def run_layout(ph: Phase, name: str) -> dict:
    from mlrl.config.schema import CriticConfig
    from mlrl.trainer.rank.critic import MegatronCritic
    from mlrl.trainer.rank.offload import Offloader
    from mlrl.trainer.rank.policy import MegatronPolicy

    opts = dict(optimizer="adam", lr=LR, total_steps=10, grad_clip=1.0, use_distributed_optimizer=name != "tp2")
    if name == "bf16":
        opts["model.dtype"] = "bfloat16"
    cfg, layout = build_cfg(ph.args, **opts)

    def policy(trainable=True):
        return MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=ph.hf_dir, trainable=trainable)

    pol, twin, ref = policy(), policy(), policy(trainable=False)
    critic = MegatronCritic(cfg.model, CriticConfig(), cfg.parallel, cfg.trainer, layout, hf_dir=ph.hf_dir)
    mbs = ph.mine(make_step(ph.vocab, n_samples=6, n_micro=2, seed=7))
    for p in (pol, twin):
        p.update(mbs, pg_loss)
    models = [pol, ref, critic]
    off = Offloader(models)

    # optimizer + grads only: parameters stay usable (the weight sync streams them)
    before_stream = hf_stream(pol)
    partial = off.offload(["optimizer", "grads"])
    stream_ok = hf_stream(pol) == before_stream
    off.reload()

    before = snapshot(models)
    resident = {k: resident_bytes(models, k) for k in ("params", "grads", "optimizer")}
    rep = off.offload(["params", "grads", "optimizer"])
    after_offload = {k: resident_bytes(models, k) for k in ("params", "grads", "optimizer")}
    again = off.offload(["params"])  # already offloaded: nothing moves
    back = off.reload()
    identical = snapshot(models) == before

    # the next step: the offloaded policy vs its twin
    m1, m2 = pol.update(mbs, pg_loss), twin.update(mbs, pg_loss)
    same_params = snapshot([pol]) == snapshot([twin])
    return {"partial": partial.to_json(), "stream_ok": stream_ok, "resident": resident, "after_offload": after_offload,
            "offload": rep.to_json(), "again": again.to_json(), "reload": back.to_json(), "identical": identical,
            "n_tensors": len(before), "loss": [m1["loss"], m2["loss"]], "grad_norm": [m1["grad_norm"], m2["grad_norm"]],
            "next_step_params_equal": same_params}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="ref,tp2,bf16")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        for name in filter(None, args.layouts.split(",")):
            torch.manual_seed(0)
            results[name] = run_layout(Phase("tiny-llama", "tp2" if name == "tp2" else "ref"), name)
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
