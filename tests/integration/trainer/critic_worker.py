"""torchrun worker for test_critic.py: the critic under several parallel layouts in ONE launch.

The first phase runs the reference layout (tp1 / pp1 / dp = world); Megatron's groups are then
torn down and rebuilt for each further layout (`--layouts tp2+sp,pp2,ep2`), whose results are
compared in memory against the reference (same process: no files between launches, one megatron
import). Each rank writes `<out>/rank<r>.json` ({"<model>/<phase>": {measure: value}}); the
assertions live in test_critic.py.

    python -m torch.distributed.run --nproc-per-node 2 critic_worker.py --out DIR \
        --models tiny-llama --layouts tp2+sp,pp2
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from hf_reference import make_step
from trainer_worker import build_cfg

# the step every phase trains on: 6 samples in 2 micro-batches (DP2: one each; DP1: both)
N_MICRO = 2
SGD_LR = 0.05       # the cross-layout update: plain SGD, so the update is the (clipped) gradient itself
ADAM_LR = 5e-4      # the loss-decrease / resume run (the loop's optimizer)


def layout_args(model: str, name: str) -> SimpleNamespace:
    """'ref' | 'tp2' | 'tp2+sp' | 'pp2' | 'ep2' -> the argument namespace of trainer_worker.build_cfg."""
    base, _, flag = name.partition("+")
    n = {"ref": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}[base]
    return SimpleNamespace(model=model, tp=n.get("tp", 1), pp=n.get("pp", 1), ep=n.get("ep", 1), cp=1, sp=flag == "sp",
                           vpp=None, pp_split=None, trainer_opts={})


class Phase:
    """One parallel layout: (re)initialises Megatron's groups and builds critics / policies in it."""

    def __init__(self, model: str, name: str):
        from mlrl.modelzoo import resolve_model_dir
        from mlrl.trainer.rank import parallel

        self.args = layout_args(model, name)
        self.cfg, self.layout = build_cfg(self.args)
        if parallel._STATE is not None:
            parallel.destroy_parallel()
        self.ranks = parallel.init_parallel(self.cfg.parallel, self.layout, seed=1234)
        self.hf_dir = resolve_model_dir(self.cfg.model.hf_dir)
        self.vocab = json.loads((self.hf_dir / "config.json").read_text())["vocab_size"]

    def critic(self, **critic_opts):
        from mlrl.config.schema import CriticConfig
        from mlrl.trainer.rank.critic import MegatronCritic

        trainer = {"optimizer": critic_opts.pop("optimizer", "adam"), "total_steps": 10}
        trainer["use_distributed_optimizer"] = (
            trainer["optimizer"] == "adam"
        )  # Megatron's DistributedOptimizer is Adam-only
        cfg, layout = build_cfg(self.args, **trainer)
        return MegatronCritic(
            cfg.model, CriticConfig(**critic_opts), cfg.parallel, cfg.trainer, layout, hf_dir=self.hf_dir
        )

    def policy(self):
        from mlrl.trainer.rank.policy import MegatronPolicy

        return MegatronPolicy(self.cfg.model, self.cfg.parallel, self.cfg.trainer, self.layout, hf_dir=self.hf_dir,
                              trainable=False)

    def mine(self, mbs):
        return mbs[self.ranks.dp::self.ranks.dp_size]


def make_critic_step(vocab: int):
    """The step's micro-batches with returns that depend only on (sample, position)."""
    mbs = make_step(vocab, n_samples=6, n_micro=N_MICRO, seed=7)
    for mb in mbs:
        mb.returns = (0.5 * torch.tanh(mb.advantages) + 0.02 * mb.position_ids).float()
    return mbs


def with_old_values(mbs, values):
    for mb, v in zip(mbs, values):
        mb.old_values = v.clone()
    return mbs


def head_weight(critic) -> torch.Tensor:
    """Values of order 1 (|V| < ~1, the scale of rewards in [0, 1]): absolute tolerances are then
    fp32 reduction-order noise of the body (a few ulp of the values)."""
    h = critic.arch.hidden_size
    return 0.5 * torch.randn(1, h, generator=torch.Generator().manual_seed(5)) / h ** 0.5


def set_head(critic, w: torch.Tensor) -> None:
    """A non-zero value head (the same on every rank), so that values differ between positions."""
    for chunk in critic.model:
        m = chunk
        while hasattr(m, "module"):
            m = m.module
        if m.post_process:
            with torch.no_grad():
                m.output_layer.weight.copy_(w.to(m.output_layer.weight.dtype))
    critic.optimizer.reload_model_params()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def step_loss(fn, mbs, values) -> float:
    return float(sum(fn(mb, v)[0] for mb, v in zip(mbs, values)))


def sgd_update(ph: Phase, mbs) -> dict:
    """The same non-zero head, one SGD update with the clipped value loss: values before and after."""
    from mlrl.algorithms.value import make_value_loss_fn

    c = ph.critic(optimizer="sgd", lr=SGD_LR, grad_clip=1.0)
    set_head(c, head_weight(c))
    before = c.compute_values(mbs)
    m = c.update(ph.mine(with_old_values(mbs, before)), make_value_loss_fn(0.2))
    after = c.compute_values(mbs)
    return {"before": before, "after": after, "loss": m["loss"], "grad_norm": m["grad_norm"],
            "clipfrac": m["value_clipfrac"] / m["n_tokens"]}


def optimizer_knobs(ph: Phase, mbs) -> dict:
    """The critic's own optimizer fields (critic.lr / min_lr / lr_schedule / lr_warmup_steps /
    weight_decay / grad_clip), each run with two values: SGD makes their effect on the values
    direct (Adam would normalise the gradient's scale away)."""
    from mlrl.algorithms.value import make_value_loss_fn

    fn = make_value_loss_fn(0.0)

    def moved(**opts) -> tuple[float, list[float]]:
        c = ph.critic(optimizer="sgd", **{"lr": SGD_LR, "grad_clip": 0.0, **opts})
        set_head(c, head_weight(c))
        before = c.compute_values(mbs)
        lrs = [c.update(ph.mine(with_old_values(mbs, before)), fn)["lr"] for _ in range(3)]
        return max_diff(c.compute_values(mbs), before), lrs

    out = {}
    out["plain"], out["plain_lrs"] = moved()
    out["clipped"], _ = moved(grad_clip=1e-4)             # the update shrinks with the clipped gradient
    out["decayed"], _ = moved(weight_decay=0.5)            # decay pulls the (non-zero) head towards 0 too
    out["half_lr"], _ = moved(lr=SGD_LR / 2)
    _, out["cosine_lrs"] = moved(lr_schedule="cosine", min_lr=SGD_LR / 10, lr_warmup_steps=1)
    return out


def reference_phase(ph: Phase, tmp: Path) -> tuple[dict, dict]:
    from mlrl.algorithms.value import make_value_loss_fn
    from mlrl.ckpt_files.errors import CheckpointError
    from mlrl.trainer.rank.dist_ckpt import load_checkpoint, save_checkpoint

    res: dict = {}
    mbs = make_critic_step(ph.vocab)

    # a fresh critic: zero head, body = the HF checkpoint's body = the policy's
    c = ph.critic(lr=ADAM_LR)
    v0 = c.compute_values(mbs)
    res["initial_abs_max"] = max(float(v.abs().max()) for v in v0)
    res["initial_dtype"] = str(v0[0].dtype)
    res["initial_shapes_ok"] = all(v.shape == mb.tokens.shape for v, mb in zip(v0, mbs))
    pol = ph.policy()
    body = {n: t.clone() for b in c.iter_hf_buckets(1 << 30) for n, t in b}
    ref = {n: t.clone() for b in pol.iter_hf_buckets(1 << 30) for n, t in b}
    res["body"] = {"sender": c.rank_info()["is_stage_sender"], "names": sorted(body), "policy_names": sorted(ref),
                   "mismatched": sorted(n for n, t in body.items() if n not in ref or not torch.equal(t, ref[n]))}
    try:
        c.compute_logprobs(mbs, 1.0)
        res["logprobs_error"] = None
    except TypeError as e:
        res["logprobs_error"] = str(e)

    # three Adam updates on one batch (plain regression); a checkpoint after the first, resumed
    # into a fresh critic whose next update must equal the uninterrupted one bit for bit
    fn = make_value_loss_fn(0.0)
    mine = ph.mine(with_old_values(mbs, v0))
    ckpt = tmp / "critic_ckpt"
    m1 = c.update(mine, fn)
    save_checkpoint(c, ckpt)
    m2 = c.update(mine, fn)
    v2 = c.compute_values(mbs)
    m3 = c.update(mine, fn)
    v3 = c.compute_values(mbs)
    res["train"] = {"losses": [m1["loss"], m2["loss"], m3["loss"]], "final_loss": step_loss(fn, mbs, v3),
                    "value_loss_1": m1["value_loss"], "lrs": [m1["lr"], m2["lr"], m3["lr"]],
                    "n_tokens": m1["n_tokens"], "loss_tokens": m1["loss_tokens"], "moved": max_diff(v3, v0)}
    b = ph.critic(lr=ADAM_LR)
    info = load_checkpoint(b, ckpt)
    b2 = b.update(mine, fn)
    vb2 = b.compute_values(mbs)
    res["resume"] = {"optimizer_loaded": info["optimizer_loaded"], "optimizer_steps": info["optimizer_steps"],
                     "loss_equal": b2["loss"] == m2["loss"], "grad_norm_equal": b2["grad_norm"] == m2["grad_norm"],
                     "lr_equal": b2["lr"] == m2["lr"], "values_equal": all(torch.equal(x, y) for x, y in zip(vb2, v2)),
                     "values_diff": max_diff(vb2, v2)}
    del b

    # roles: a critic checkpoint does not load into a policy, nor a policy checkpoint into a critic
    errors = {}
    try:
        load_checkpoint(pol, ckpt)
        errors["critic_into_policy"] = None
    except CheckpointError as e:
        errors["critic_into_policy"] = str(e)
    save_checkpoint(pol, tmp / "policy_ckpt")
    try:
        load_checkpoint(c, tmp / "policy_ckpt")
        errors["policy_into_critic"] = None
    except CheckpointError as e:
        errors["policy_into_critic"] = str(e)
    res["role_errors"] = errors
    del c, pol

    res["knobs"] = optimizer_knobs(ph, mbs)
    sgd = sgd_update(ph, mbs)
    res["sgd"] = {
        "loss": sgd["loss"],
        "grad_norm": sgd["grad_norm"],
        "clipfrac": sgd["clipfrac"],
        "moved": max_diff(sgd["after"], sgd["before"]),
        "values_abs_max": max(float(v.abs().max()) for v in sgd["before"]),
    }
    return res, sgd


def layout_phase(ph: Phase, ref: dict) -> dict:
    mbs = make_critic_step(ph.vocab)
    got = sgd_update(ph, mbs)
    return {
        "values_err": max_diff(got["before"], ref["before"]),
        "after_err": max_diff(got["after"], ref["after"]),
        "loss": got["loss"],
        "grad_norm": got["grad_norm"],
        "ref_loss": ref["loss"],
        "ref_grad_norm": ref["grad_norm"],
        "ranks": ph.ranks.as_dict(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="tiny-llama")
    ap.add_argument(
        "--layouts", default="tp2+sp,pp2", help="after the reference; a model:layout entry runs only for that model"
    )
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        for model in args.models.split(","):
            torch.manual_seed(0)
            ph = Phase(model, "ref")
            tmp = Path(args.out) / model
            if rank == 0:
                tmp.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            results[f"{model}/ref"], ref = reference_phase(ph, tmp)
            for entry in args.layouts.split(","):
                only, _, name = entry.rpartition(":")
                if only and only != model:
                    continue
                results[f"{model}/{name}"] = layout_phase(Phase(model, name), ref)
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
