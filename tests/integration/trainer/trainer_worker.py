"""torchrun worker for the trainer integration tests: runs named checks on one layout and writes
one JSON per rank (`<out>/rank<r>.json`: {check: {measure: value}}). Assertions live in the
pytest files; this only measures.

    python -m torch.distributed.run --nproc-per-node N trainer_worker.py --out DIR \
        --models tiny-llama,tiny-qwen3-moe+sp --tp 2 --checks parity,export,grads,adam,bad_input@tiny-llama

A model suffixed `+sp` runs with sequence parallelism; a check suffixed `@model` runs only for
that model. Results are keyed "<model>/<check>".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from hf_reference import hf_adamw_steps, hf_loss_and_grads, hf_row, make_step, pg_loss


def build_cfg(args, **trainer):
    from mlrl.config.schema import Config
    from mlrl.config.validate import resolve_layout

    cfg = Config()
    cfg.model.hf_dir = f"builtin:{args.model}" if ":" not in args.model and "/" not in args.model else args.model
    world = int(os.environ["WORLD_SIZE"])
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp = args.tp, args.pp, args.ep, args.cp
    cfg.parallel.sequence_parallel = args.sp
    cfg.parallel.vpp = args.vpp
    cfg.parallel.pp_layer_split = [int(x) for x in args.pp_split.split(",")] if args.pp_split else None
    cfg.cluster.trainer_devices = world  # dp = world / (tp*pp*cp)
    for k, v in {**args.trainer_opts, **trainer}.items():
        section, _, name = k.rpartition(".")  # a dotted key names another section (model.dtype=bfloat16)
        target = getattr(cfg, section) if section else cfg.trainer
        if not hasattr(target, name):
            raise ValueError(f"--trainer-opts {k}: {type(target).__name__} has no field {name!r}")
        setattr(target, name, {"true": True, "false": False}.get(v, v) if isinstance(v, str) else v)
    return cfg, resolve_layout(cfg)


class Ctx:
    def __init__(self, args):
        from mlrl.modelzoo import resolve_model_dir
        from mlrl.trainer.rank.policy import init_parallel

        self.args = args
        self.cfg, self.layout = build_cfg(args)
        self.ranks = init_parallel(self.cfg.parallel, self.layout, seed=1234)
        self.hf_dir = resolve_model_dir(self.cfg.model.hf_dir)
        self.hf_config = json.loads((self.hf_dir / "config.json").read_text())
        self.vocab = self.hf_config["vocab_size"]
        self._hf = None

    def hf_model(self):
        import transformers

        if self._hf is None:
            self._hf = transformers.AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()
        return self._hf

    def policy(self, trainable: bool, **trainer):
        from mlrl.trainer.rank.policy import MegatronPolicy

        cfg, layout = build_cfg(self.args, **trainer)
        return MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=self.hf_dir, trainable=trainable)

    def my_micro_batches(self, step_mbs):
        """This DP rank's share of a step's micro-batches (round robin)."""
        r = self.ranks
        return step_mbs[r.dp::r.dp_size]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check_parity(ctx: Ctx) -> dict:
    pol = ctx.policy(trainable=False)
    mbs = ctx.my_micro_batches(make_step(ctx.vocab, n_samples=6, n_micro=2 * ctx.ranks.dp_size, seed=7))
    hf = ctx.hf_model()
    logits = pol.compute_logits(mbs)
    res = {
        "logits": 0.0,
        "logprob": 0.0,
        "entropy": 0.0,
        "logprob_t07": 0.0,
        "entropy_t07": 0.0,
        "first_token_zero": True,
    }
    for T, suffix in ((1.0, ""), (0.7, "_t07")):
        out = pol.compute_logprobs(mbs, T)
        for mb, (lp, ent), lg in zip(mbs, out, logits):
            ref_lp, ref_ent, ref_logits = hf_row(hf, mb, T)
            res["logprob" + suffix] = max(res["logprob" + suffix], _max_abs(lp, ref_lp))
            res["entropy" + suffix] = max(res["entropy" + suffix], _max_abs(ent, ref_ent))
            res["first_token_zero"] &= bool(
                (lp[mb.cu_seqlens[:-1].long()] == 0).all() and (lp[mb.cu_seqlens[-1] :] == 0).all()
            )
            if T == 1.0:
                cu = mb.cu_seqlens.tolist()
                for (a, b), rl in zip(zip(cu[:-1], cu[1:]), ref_logits):
                    res["logits"] = max(res["logits"], _max_abs(lg[a:b], rl))
    return res


def _hf_tensors(ctx: Ctx) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ctx.hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_export(ctx: Ctx) -> dict:
    pol = ctx.policy(trainable=False)
    got = {}
    n_buckets = 0
    for bucket in pol.iter_hf_buckets(bucket_bytes=64 * 1024):
        n_buckets += 1
        for name, t in bucket:
            if name in got:
                raise AssertionError(f"{name} exported twice")
            got[name] = t.cpu()
    ref = _hf_tensors(ctx)
    mismatched = sorted(
        n for n, t in got.items() if n not in ref or t.dtype != ref[n].dtype or not torch.equal(t, ref[n])
    )
    return {"names": sorted(got), "mismatched": mismatched, "buckets": n_buckets,
            "sender": pol.rank_info()["is_stage_sender"], "hf_names": sorted(ref)}


def _export_grads(pol) -> dict:
    return {n: t.clone().cpu() for b in pol.iter_hf_buckets(1 << 30, grads=True) for n, t in b}


def check_grads(ctx: Ctx) -> dict:
    """Loss and gradients vs HF, for the step packed into 1 x dp and 4 x dp micro-batches."""
    res = {}
    hf = ctx.hf_model()
    grads_by_split = {}
    for n_micro in (1, 4):
        step = make_step(ctx.vocab, n_samples=8, n_micro=n_micro * ctx.ranks.dp_size, seed=11)
        pol = ctx.policy(trainable=True, use_distributed_optimizer=False, grad_clip=0.0)
        metrics = pol.update(ctx.my_micro_batches(step), pg_loss, step=False)
        grads = _export_grads(pol)
        ref_loss, ref_grads = hf_loss_and_grads(copy.deepcopy(hf).train(), step)
        res[f"loss_{n_micro}"] = metrics["loss"]
        res[f"loss_err_{n_micro}"] = abs(metrics["loss"] - ref_loss)
        res[f"grad_err_{n_micro}"] = max((_max_abs(g, ref_grads[n]) for n, g in grads.items()), default=0.0)
        res[f"grad_max_{n_micro}"] = max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
        res[f"tokens_{n_micro}"] = metrics["tokens"]
        res[f"lp_range_{n_micro}"] = (metrics["lp_min"], metrics["lp_max"])
        res[f"names_{n_micro}"] = sorted(grads)
        grads_by_split[n_micro] = grads
        del pol
    res["ref_names"] = sorted(ref_grads)  # every HF parameter with a gradient: what the ranks must cover
    common = set(grads_by_split[1]) & set(grads_by_split[4])
    res["split_grad_diff"] = max((_max_abs(grads_by_split[1][n], grads_by_split[4][n]) for n in common), default=0.0)
    res["split_loss_diff"] = abs(res["loss_1"] - res["loss_4"])
    return res


def shared_prefix_samples(vocab: int, seed: int = 5):
    """Three prompt groups of 4 samples (prompts of 5, 9 and 3 tokens, responses of 1-6) and one
    sample of no group; random advantages."""
    from mlrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []

    def rand(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    for grp, plen in enumerate((5, 9, 3)):
        prompt = rand(plen)
        for _ in range(4):
            toks = prompt + rand(int(torch.randint(1, 7, (1,), generator=g)))
            samples.append(Sample(tokens=toks, loss_mask=[0] * plen + [1] * (len(toks) - plen),
                                  rollout_logprobs=[0.0] * len(toks), versions=[0] * len(toks), prompt_len=plen,
                                  group_id=f"g{grp}", advantage=float(torch.randn(1, generator=g))))
    toks = rand(7)
    samples.append(Sample(tokens=toks, loss_mask=[0] * 4 + [1] * 3, rollout_logprobs=[0.0] * 7, versions=[0] * 7,
                          prompt_len=4, advantage=0.5))
    return samples


def check_shared_prefix(ctx: Ctx) -> dict:
    """trainer.shared_prefix_packing: the same samples packed with one copy of each group's prompt
    vs one per sample (token budget 24: the 9-token group is cut into two units, each with its
    copy), on the same weights: logprobs / entropy of the policy tokens, loss and gradients."""
    from mlrl.experience.packing import pack_step, unpack_per_sample

    assert ctx.ranks.dp_size == 1, "check_shared_prefix runs without data parallelism"
    samples = shared_prefix_samples(ctx.vocab)
    res, lps, ents, grads = {}, {}, {}, {}
    for shared in (False, True):
        mbs, metrics = pack_step(samples, dp_size=1, token_budget=24, loss_agg="token-mean", shared_prefix=shared)
        mbs = mbs[0]
        res[f"tokens_{shared}"] = metrics["pack/num_tokens"]
        res[f"micro_batches_{shared}"] = len(mbs)
        pol = ctx.policy(trainable=True, use_distributed_optimizer=False, grad_clip=0.0)
        out = pol.compute_logprobs(mbs, 0.8)
        lps[shared] = unpack_per_sample(mbs, [lp for lp, _ in out], len(samples))
        ents[shared] = unpack_per_sample(mbs, [e for _, e in out], len(samples))
        res[f"loss_{shared}"] = pol.update(mbs, pg_loss, temperature=0.8, step=False)["loss"]
        grads[shared] = _export_grads(pol)
        del pol
    masks = [torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples]
    res["logprob_diff"] = max(_max_abs(a[m], b[m]) for a, b, m in zip(lps[False], lps[True], masks))
    res["entropy_diff"] = max(_max_abs(a[m], b[m]) for a, b, m in zip(ents[False], ents[True], masks))
    res["logprob_max"] = max(float(a[m].abs().max()) for a, m in zip(lps[False], masks))
    # (with pipeline parallelism a rank exports the gradients of its own stage only, possibly none)
    res["grad_diff"] = max((_max_abs(grads[False][n], grads[True][n]) for n in grads[False]), default=0.0)
    res["grad_max"] = max((float(g.abs().max()) for g in grads[False].values()), default=0.0)
    res["grad_names_equal"] = sorted(grads[False]) == sorted(grads[True])
    return res


def check_adam(ctx: Ctx) -> dict:
    """Three optimizer steps with Megatron's DistributedOptimizer vs torch AdamW on the HF model."""
    # adam_eps 1e-5: Adam's update is most sensitive to a gradient element's value, lr / eps per
    # unit, where |g| << eps; with the default 1e-8 fp32 reduction-order noise (~1e-9) in a near-zero
    # gradient element moves its update by up to ~10% of lr and hides real mismatches.
    kw = dict(lr=1e-3, lr_warmup_steps=2, weight_decay=0.01, grad_clip=0.5, total_steps=10,
              use_distributed_optimizer=True, adam_eps=1e-5)
    steps = [make_step(ctx.vocab, n_samples=6, n_micro=2 * ctx.ranks.dp_size, seed=20 + k) for k in range(3)]
    pol = ctx.policy(trainable=True, **kw)
    metrics = [pol.update(ctx.my_micro_batches(s), pg_loss) for s in steps]
    got = {n: t.clone().cpu() for b in pol.iter_hf_buckets(1 << 30) for n, t in b}
    ref = hf_adamw_steps(copy.deepcopy(ctx.hf_model()).train(), steps, lr=kw["lr"], warmup=kw["lr_warmup_steps"],
                         weight_decay=kw["weight_decay"], clip=kw["grad_clip"], eps=kw["adam_eps"])
    # the reference's own noise floor: the same steps packed into one micro-batch each
    alt = [make_step(ctx.vocab, n_samples=6, n_micro=1, seed=20 + k) for k in range(3)]
    ref_alt = hf_adamw_steps(copy.deepcopy(ctx.hf_model()).train(), alt, lr=kw["lr"], warmup=kw["lr_warmup_steps"],
                             weight_decay=kw["weight_decay"], clip=kw["grad_clip"], eps=kw["adam_eps"])
    init = _hf_tensors(ctx)
    return {
        "param_err": max((_max_abs(t, ref[n]) for n, t in got.items()), default=0.0),
        "param_err_mean": float(
            sum((t - ref[n]).abs().sum() for n, t in got.items()) / max(1, sum(t.numel() for t in got.values()))
        ),
        "ref_noise": max((_max_abs(ref_alt[n], ref[n]) for n in ref), default=0.0),
        "moved": max((_max_abs(t, init[n]) for n, t in got.items()), default=0.0),
        "lrs": [m["lr"] for m in metrics],
        "grad_norms": [m["grad_norm"] for m in metrics],
        "losses": [m["loss"] for m in metrics],
        "names": sorted(got),
        "ref_names": sorted(ref),
    }


def check_optim_knobs(ctx: Ctx) -> dict:
    """trainer.adam_beta1/2, grad_clip, lr_schedule/min_lr, each against a torch reference that
    uses the knob and one that does not (the knob is live when Megatron matches the first and the
    two references differ by far more than that error)."""
    import math

    steps = [make_step(ctx.vocab, n_samples=6, n_micro=2 * ctx.ranks.dp_size, seed=40 + k) for k in range(3)]
    res: dict = {}

    def megatron(**kw):
        pol = ctx.policy(trainable=True, use_distributed_optimizer=True, total_steps=10, **kw)
        metrics = [pol.update(ctx.my_micro_batches(s), pg_loss) for s in steps]
        got = {n: t.clone().cpu() for b in pol.iter_hf_buckets(1 << 30) for n, t in b}
        del pol
        return got, metrics

    def ref(**kw):
        return hf_adamw_steps(copy.deepcopy(ctx.hf_model()).train(), steps, **kw)

    def gap(a, b):
        return max((_max_abs(t, b[n]) for n, t in a.items()), default=0.0)

    base = dict(lr=1e-3, warmup=0, weight_decay=0.0, clip=0.0, eps=1e-5)
    # betas: (0.5, 0.9) against the defaults (0.9, 0.999)
    got, _ = megatron(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0, grad_clip=0.0, adam_eps=1e-5,
                      adam_beta1=0.5, adam_beta2=0.9)
    with_knob, without = ref(**base, betas=(0.5, 0.9)), ref(**base)
    res["betas_err"], res["betas_effect"] = gap(got, with_knob), gap(with_knob, without)
    # grad_clip far below the gradient norm: Adam divides the clipped gradient by sqrt(v) + eps, so
    # with adam_eps comparable to the clipped elements the update shrinks (without eps Adam is
    # scale-invariant and clipping would not show in the weights)
    got, metrics = megatron(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0, grad_clip=1e-4, adam_eps=1e-5)
    with_knob, without = ref(**{**base, "clip": 1e-4}), ref(**base)
    res["clip_err"], res["clip_effect"] = gap(got, with_knob), gap(with_knob, without)
    res["clip_grad_norms"] = [m["grad_norm"] for m in metrics]  # before clipping: far above 1e-4
    # lr_schedule cosine from lr to min_lr over total_steps * updates (10) after 2 warm-up steps
    _, metrics = megatron(lr=1e-3, lr_warmup_steps=2, lr_schedule="cosine", min_lr=1e-4, weight_decay=0.0)
    res["cosine_lrs"] = [m["lr"] for m in metrics]
    res["cosine_want"] = [1e-3 * k / 2 if k <= 2 else
                          1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in (1, 2, 3)]
    _, metrics = megatron(lr=1e-3, lr_warmup_steps=2, lr_schedule="constant", min_lr=1e-4, weight_decay=0.0)
    res["constant_lrs"] = [m["lr"] for m in metrics]
    return res


def check_bad_input(ctx: Ctx) -> dict:
    """Errors raised before the model is built: each entry is the error message (or None)."""
    import shutil
    import tempfile

    from mlrl.config.validate import Layout
    from mlrl.trainer.rank.policy import MegatronPolicy

    cfg, layout = build_cfg(ctx.args)
    out = {}

    def attempt(key, hf_dir, lay=layout):
        try:
            MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, lay, hf_dir=hf_dir, trainable=False)
            out[key] = None
        except Exception as e:  # the message is the result
            out[key] = f"{type(e).__name__}: {e}"

    tmp = Path(tempfile.mkdtemp(prefix="mlrl-bad-"))
    try:
        def copy_model(name):
            d = tmp / name
            shutil.copytree(ctx.hf_dir, d)
            return d

        d = copy_model("missing")
        for f in d.glob("*.safetensors"):
            f.unlink()
        attempt("missing_safetensors", d)
        d = copy_model("truncated")
        f = next(d.glob("*.safetensors"))
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
        attempt("truncated_safetensors", d)
        d = copy_model("shape")
        conf = json.loads((d / "config.json").read_text())
        conf["intermediate_size"] = conf["intermediate_size"] * 2
        (d / "config.json").write_text(json.dumps(conf))
        attempt("shape_mismatch", d)
        d = copy_model("layers")
        conf = json.loads((d / "config.json").read_text())
        conf["num_hidden_layers"] += 1
        (d / "config.json").write_text(json.dumps(conf))
        attempt("missing_layer", d)
        d = copy_model("mtype")
        conf = json.loads((d / "config.json").read_text())
        conf["model_type"] = "gpt_bigcode"
        (d / "config.json").write_text(json.dumps(conf))
        attempt("unknown_model_type", d)
        bad = Layout(
            tp=3, pp=1, cp=1, ep=1, etp=3, dp=1, vpp=None, trainer_devices=3, rollout_devices=0, total_devices=0
        )
        attempt("tp_not_dividing_heads", ctx.hf_dir, bad)
        bad = Layout(
            tp=1, pp=3, cp=1, ep=1, etp=1, dp=1, vpp=None, trainer_devices=3, rollout_devices=0, total_devices=0
        )
        attempt("pp_not_dividing_layers", ctx.hf_dir, bad)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_state(ctx: Ctx) -> dict:
    """The checkpoint hooks: Megatron sharded state dicts of model, optimizer and scheduler."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pol = ctx.policy(trainable=True)
    pol.update(ctx.my_micro_batches(make_step(ctx.vocab, n_samples=4, n_micro=ctx.ranks.dp_size, seed=3)), pg_loss)
    sd = pol.sharded_state_dict()
    model_sd = sd["model"]
    sharded = [k for k, v in model_sd.items() if isinstance(v, ShardedTensor)]
    return {"keys": sorted(sd), "model_sharded_tensors": len(sharded), "optimizer_type": type(sd["optimizer"]).__name__,
            "scheduler_steps": sd["scheduler"]["num_steps"], "has_ref": ctx.policy(trainable=False).optimizer is None}


def check_rope(ctx: Ctx) -> dict:
    """RoPE scaling over long positions: Megatron logits vs HF on samples of 100-250 tokens, and
    the gap of HF's own logits without the scaling (how far a bridge that ignored it would be)."""
    import transformers
    from hf_reference import make_samples, pack

    samples = make_samples(ctx.vocab, 3, seed=11, min_len=100, max_len=250)
    total = sum(len(s) - len(s) // 2 for s in samples)
    mbs = ctx.my_micro_batches([pack(samples, list(range(3)), total, seed=11)] * ctx.ranks.dp_size)
    pol = ctx.policy(trainable=False)
    logits = pol.compute_logits(mbs)
    cfg = {k: v for k, v in ctx.hf_config.items() if k not in ("rope_scaling", "rope_parameters")}
    cfg["rope_theta"] = ctx.hf_config.get("rope_parameters", {}).get("rope_theta", ctx.hf_config.get("rope_theta"))
    plain = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          dtype=torch.float32).eval()
    plain.load_state_dict(ctx.hf_model().state_dict())
    res = {"logits": 0.0, "unscaled_gap": 0.0, "positions": max(len(s) for s in samples)}
    for mb, lg in zip(mbs, logits):
        cu = mb.cu_seqlens.tolist()
        with torch.no_grad():
            for a, b in zip(cu[:-1], cu[1:]):
                ref = ctx.hf_model()(mb.tokens[a:b][None]).logits[0].float()
                res["logits"] = max(res["logits"], _max_abs(lg[a:b], ref))
                res["unscaled_gap"] = max(res["unscaled_gap"], _max_abs(plain(mb.tokens[a:b][None]).logits[0], ref))
    return res


CHECKS = {"parity": check_parity, "export": check_export, "grads": check_grads, "adam": check_adam,
          "optim_knobs": check_optim_knobs,
          "bad_input": check_bad_input, "state": check_state, "rope": check_rope,
          "shared_prefix": check_shared_prefix}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument(
        "--models", default=None, help="comma list: run the checks for each model (same layout); +sp suffix"
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--pp-split", default=None, help="layers per pipeline stage, e.g. 3,1")
    ap.add_argument("--trainer-opts", default="",
                    help="k=v,... TrainerConfig overrides, other sections' by dotted name (e.g. model.dtype=bfloat16)")
    ap.add_argument("--checks", required=True)
    args = ap.parse_args()
    args.trainer_opts = dict(kv.split("=", 1) for kv in args.trainer_opts.split(",") if kv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    results: dict = {}
    rank = int(os.environ.get("RANK", "0"))
    models = args.models.split(",") if args.models else [args.model]
    ctx = None
    try:
        for model in models:
            args.model, _, flag = model.partition("+")
            args.sp = flag == "sp"
            ctx = Ctx(args) if ctx is None else _retarget(ctx, args)
            for check in args.checks.split(","):
                name, _, only = check.partition("@")
                if only and model not in only.split("|"):  # check@m1|m2: only for those models
                    continue
                torch.manual_seed(0)
                results[f"{model}/{name}"] = CHECKS[name](ctx)
        results["ranks"] = ctx.ranks.as_dict()
        from mlrl.trainer.rank import logprob_kernels  # which logprob pass ran: Triton kernels or torch
        from mlrl.trainer.rank.parallel import device

        results["logprob_kernels"] = logprob_kernels.available(torch.empty(0, device=device()))
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _retarget(ctx: Ctx, args) -> Ctx:
    from mlrl.modelzoo import resolve_model_dir

    ctx.args = args
    ctx.cfg, ctx.layout = build_cfg(args)
    ctx.hf_dir = resolve_model_dir(ctx.cfg.model.hf_dir)
    ctx.hf_config = json.loads((ctx.hf_dir / "config.json").read_text())
    ctx.vocab = ctx.hf_config["vocab_size"]
    ctx._hf = None
    return ctx


if __name__ == "__main__":
    main()
