"""torchrun worker for test_lora.py: LoRA on the Megatron policy under several layouts in ONE launch.

Reference layout (tp1, dp2, distributed Adam) on tiny-llama:
- B = 0: logits bit-identical to the base model;
- three Adam updates: only adapter tensors change (the base is bit-identical before / after),
  the loss falls; with adapters disabled the logprobs equal a base policy's bit for bit;
- merged export (W + s B A) loaded into a plain policy gives the adapter policy's logits;
- PEFT export (rank 0) loads in peft on the HF base and matches the policy's logits;
- checkpoint after update 1 (adapters + optimizer only) resumes bit-exactly; it does not load
  into a policy without LoRA.
Further layouts (tp2, tp2+sp, pp2): the same initial adapters and two SGD updates; logits before
/ after and the merged-vs-adapter gap are reported for comparison with the reference.
Each rank writes `<out>/rank<r>.json`; assertions live in test_lora.py.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from critic_worker import Phase, max_diff
from hf_reference import make_step, pg_loss

LORA = {"rank": 8, "alpha": 16.0}
ADAM_LR = 2e-2
SGD_LR = 0.2


class LoRAPhase(Phase):
    def lora_policy(self, *, optimizer: str = "adam", lr: float = ADAM_LR, trainable: bool = True, **lora):
        from trainer_worker import build_cfg

        from mlrl.config.schema import LoRAConfig
        from mlrl.trainer.rank.policy import MegatronPolicy

        cfg, layout = build_cfg(self.args, optimizer=optimizer, lr=lr, total_steps=10, grad_clip=0.0,
                                use_distributed_optimizer=optimizer == "adam",
                                **{"model.lora": LoRAConfig(**{**LORA, **lora})})
        return MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=self.hf_dir, trainable=trainable)

    def plain(self, hf_dir=None):
        from mlrl.trainer.rank.policy import MegatronPolicy

        return MegatronPolicy(self.cfg.model, self.cfg.parallel, self.cfg.trainer, self.layout,
                              hf_dir=hf_dir or self.hf_dir, trainable=False)


def base_tensors(p) -> dict[str, torch.Tensor]:
    """The frozen base as HF tensors (no merge), on the stage sender."""
    return {n: t.clone() for n, t in p.params.iter_hf()}


def adapter_tensors(p) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in p.iter_adapters()}


def logits(p, mbs) -> list[torch.Tensor]:
    return p.compute_logits(mbs)


def peft_check(ph: LoRAPhase, adapters: dict[str, torch.Tensor], folder: Path, mbs, want: list[torch.Tensor]) -> dict:
    """Rank 0: write the PEFT folder, load it with peft on the HF base, compare logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlrl.ckpt_files.peft_adapter import write_peft_adapter
    from mlrl.config.schema import LoRAConfig

    write_peft_adapter(folder, adapters, LoRAConfig(**LORA), base_model=str(ph.hf_dir))
    base = AutoModelForCausalLM.from_pretrained(ph.hf_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    err = 0.0
    for mb, w in zip(mbs, want):
        cu = mb.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            with torch.no_grad():
                got = model(mb.tokens[a:b][None]).logits[0].float()
            err = max(err, float((got - w[a:b]).abs().max()))
    return {"files": sorted(f.name for f in folder.iterdir()), "logits_err": err}


def reference_phase(ph: LoRAPhase, tmp: Path) -> tuple[dict, dict]:
    from mlrl.ckpt_files.errors import CheckpointError
    from mlrl.trainer.rank.dist_ckpt import load_checkpoint, save_checkpoint
    from mlrl.trainer.rank.hf_export import export_hf

    res: dict = {}
    mbs = make_step(ph.vocab, n_samples=6, n_micro=2, seed=7)
    mine = ph.mine(mbs)
    p = ph.lora_policy()
    base = ph.plain()
    l0, lb = logits(p, mbs), logits(base, mbs)
    res["b0_identical"] = all(torch.equal(x, y) for x, y in zip(l0, lb))
    res["b0_err"] = max_diff(l0, lb)  # GPU: the LoRA policy's unfused TE norms vs the fused base kernels
    res["trainable"] = sorted({n.split(".")[-1] for m in p.model for n, q in m.named_parameters() if q.requires_grad})
    res["n_frozen_with_grad"] = sum(int(q.requires_grad) for q in p.lora.base)
    before = base_tensors(p)
    ckpt = tmp / "lora_ckpt"
    m1 = p.update(mine, pg_loss)
    save_checkpoint(p, ckpt)
    a1 = adapter_tensors(p)
    m2 = p.update(mine, pg_loss)
    a2 = adapter_tensors(p)
    m3 = p.update(mine, pg_loss)
    after = base_tensors(p)
    res["base_unchanged"] = sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    res["adapters_moved"] = {n: float((a2[n] - a1[n]).abs().max()) for n in a1}
    res["losses"] = [m1["loss"], m2["loss"], m3["loss"]]
    l3 = logits(p, mbs)
    res["logits_moved"] = max_diff(l3, l0)

    # the reference for KL: adapters off == the base policy, bit for bit
    with p.lora.disabled():
        ref_lp = p.compute_logprobs(mbs, 1.0)
    base_lp = base.compute_logprobs(mbs, 1.0)
    res["disabled_equals_base"] = all(torch.equal(x[0], y[0]) for x, y in zip(ref_lp, base_lp))
    res["disabled_err"] = max(float((x[0] - y[0]).abs().max()) for x, y in zip(ref_lp, base_lp))

    # merged export -> a plain policy: same logits as the adapters
    export_hf(p, tmp / "merged", dtype=None)
    merged = ph.plain(tmp / "merged")
    res["merged_err"] = max_diff(logits(merged, mbs), l3)
    del merged

    # the PEFT export: loads in peft, matches
    adapters = p.gather_adapters()
    if ph.ranks.rank == 0:
        res["peft"] = peft_check(ph, adapters, tmp / "peft", mbs, l3)
        res["adapter_bytes"] = sum(t.numel() * t.element_size() for t in adapters.values())
        res["base_bytes"] = sum(t.numel() * t.element_size() for t in before.values())
    dist.barrier()

    # resume: adapters + optimizer from the checkpoint, update 2 again -> bit-identical
    q = ph.lora_policy()
    info = load_checkpoint(q, ckpt)
    res["resume_loaded_adapters"] = all(torch.equal(t, a1[n]) for n, t in adapter_tensors(q).items())
    q2 = q.update(mine, pg_loss)
    res["resume"] = {"optimizer_loaded": info["optimizer_loaded"], "loss_equal": q2["loss"] == m2["loss"],
                     "grad_norm_equal": q2["grad_norm"] == m2["grad_norm"],
                     "adapters_equal": all(torch.equal(t, a2[n]) for n, t in adapter_tensors(q).items())}
    from megatron.core.dist_checkpointing import load_tensors_metadata

    res["ckpt_model_keys"] = sorted(k for k in load_tensors_metadata(str(ckpt)) if not k.startswith("optimizer"))
    del q
    try:
        load_checkpoint(base, ckpt)
        res["into_plain_error"] = None
    except CheckpointError as e:
        res["into_plain_error"] = str(e)
    del p, base
    return res, sgd_run(ph, mbs)


def knobs_phase(ph: LoRAPhase) -> dict:
    """Every model.lora field changes what one SGD update does (same data, same seed)."""
    mbs = make_step(ph.vocab, n_samples=6, n_micro=2, seed=7)

    def one_step(**lora) -> tuple[list[torch.Tensor], list[str]]:
        p = ph.lora_policy(optimizer="sgd", lr=SGD_LR, **lora)
        before = logits(p, mbs)
        p.update(ph.mine(mbs), pg_loss)
        names = sorted({a.spec.module for a in p.lora.adapters()})
        return [x - y for x, y in zip(logits(p, mbs), before)], names

    base, names = one_step()
    res = {"all_linear": names}
    for key, value in (("alpha", 64.0), ("init", "gaussian"), ("dropout", 0.5), ("target_modules", ["q_proj"])):
        moved, names = one_step(**{key: value})
        res[key] = {"diff_vs_default": max_diff(moved, base), "moved": max(float(m.abs().max()) for m in moved),
                    "names": names}
    res["default_moved"] = max(float(m.abs().max()) for m in base)
    return res


def sgd_run(ph: LoRAPhase, mbs) -> dict:
    """The same initial adapters, two SGD updates: logits before / after, merged gap."""
    p = ph.lora_policy(optimizer="sgd", lr=SGD_LR)
    before = logits(p, mbs)
    ms = [p.update(ph.mine(mbs), pg_loss) for _ in range(2)]
    after = logits(p, mbs)
    return {"before": before, "after": after, "losses": [m["loss"] for m in ms],
            "grad_norms": [m["grad_norm"] for m in ms], "policy": p}


def layout_phase(ph: LoRAPhase, ref: dict, tmp: Path) -> dict:
    from mlrl.trainer.rank.hf_export import export_hf

    mbs = make_step(ph.vocab, n_samples=6, n_micro=2, seed=7)
    got = sgd_run(ph, mbs)
    out = tmp / f"merged_{ph.args.tp}_{ph.args.pp}_{int(ph.args.sp)}"
    export_hf(got["policy"], out, dtype=None)
    merged = ph.plain(out)
    return {"before_err": max_diff(got["before"], ref["before"]), "after_err": max_diff(got["after"], ref["after"]),
            "moved": max_diff(got["after"], got["before"]), "losses": got["losses"], "ref_losses": ref["losses"],
            "grad_norms": got["grad_norms"], "ref_grad_norms": ref["grad_norms"],
            "merged_err": max_diff(logits(merged, mbs), got["after"]),
            "logits_absmax": max(float(x.abs().max()) for x in got["after"]), "ranks": ph.ranks.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="tp2,tp2+sp,pp2")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        torch.manual_seed(0)
        ph = LoRAPhase("tiny-llama", "ref")
        tmp = Path(args.out) / "work"
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        results["ref"], ref = reference_phase(ph, tmp)
        results["ref"]["sgd_losses"] = ref["losses"]
        results["knobs"] = knobs_phase(ph)
        for name in filter(None, args.layouts.split(",")):
            results[name] = layout_phase(LoRAPhase("tiny-llama", name), ref, tmp)
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
