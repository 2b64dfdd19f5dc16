"""torchrun worker for the checkpoint integration tests: runs named phases on one layout and
writes one JSON per rank (`<out>/rank<r>.json`). Measures only; the assertions are in pytest.

    python -m torch.distributed.run --nproc-per-node 2 ckpt_worker.py --out DIR --work DIR \
        --model tiny-llama --tp 2 --phases train_save,resume:tp2_fr

Phases (all checkpoints live under --work; `phase:tag@model` runs a phase on another model):
- train_save:<tag>   policy A trains 4 steps straight (losses; HF export <tag>_straight_hf);
                     policy B trains 2 steps, saves <tag>_fr (fully_reshardable optimizer state)
                     and <tag>_dpr (dp_reshardable), exports <tag>_step2_hf, then draws from
                     every RNG.
- resume:<tag>       a fresh policy loads <tag>_fr (any layout), draws from every RNG, trains
                     steps 3 and 4 (losses), exports HF to <tag>_resumed_<layout>_hf, and writes
                     the policy's logits of a probe batch for the export parity check.
- errors:<tag>       bad inputs: missing / incomplete checkpoint, another architecture (qwen3;
                     --other-model: another hidden size), a dp_reshardable checkpoint after a
                     TP change; the policy's weights must stay untouched.
- kill_save:<tag>    1 step, driver-style save + commit (step 1), 1 more step, then a save into a
                     fresh temporary folder that blocks before Megatron's finalisation (the
                     test SIGKILLs the whole process group there).
- kill_resume:<tag>  resolve_resume('auto') on the killed run's root, load, 1 step.
- async_save:<tag>   (tests/gpu) policy A trains 2 steps, saves with async_save=True into a
                     manager's temporary folder, trains step 3 while the shards are written,
                     then finalizes and commits; a fresh policy B resumes from
                     resolve_resume('auto') and trains step 3. On CPU the save is synchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from hf_reference import make_step, pg_loss

TRAIN = dict(lr=1e-3, lr_warmup_steps=2, weight_decay=0.01, grad_clip=0.5, total_steps=10,
             use_distributed_optimizer=True)


def build_cfg(args, model=None, **trainer):
    from mlrl.config.schema import Config
    from mlrl.config.validate import resolve_layout

    cfg = Config()
    name = model or args.model
    cfg.model.hf_dir = name if "/" in name else f"builtin:{name}"
    world = int(os.environ["WORLD_SIZE"])
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = args.tp, args.pp, args.ep
    cfg.cluster.trainer_devices = world  # dp = world / (tp*pp)
    cfg.parallel.sequence_parallel = args.tp > 1 and "moe" in (model or args.model)
    for k, v in {**TRAIN, **trainer}.items():
        setattr(cfg.trainer, k, v)
    return cfg, resolve_layout(cfg)


class Ctx:
    def __init__(self, args):
        from mlrl.trainer.rank.policy import init_parallel

        self.args = args
        self.cfg, self.layout = build_cfg(args)
        self.ranks = init_parallel(self.cfg.parallel, self.layout, seed=1234)
        self.work = Path(args.work)
        self.tag_layout = f"tp{args.tp}pp{args.pp}ep{args.ep}dp{self.ranks.dp_size}"
        self.phase_model = None  # a phase spec's @model

    def policy(self, model=None, trainable=True, **trainer):
        from mlrl.modelzoo import resolve_model_dir
        from mlrl.trainer.rank.policy import MegatronPolicy

        cfg, layout = build_cfg(self.args, model or self.phase_model, **trainer)
        return MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=resolve_model_dir(cfg.model.hf_dir),
                              trainable=trainable)

    def step_batches(self, pol, k: int):
        step = make_step(pol.arch.vocab_size, n_samples=6, n_micro=2 * self.ranks.dp_size, seed=20 + k)
        return step[self.ranks.dp::self.ranks.dp_size]


def rng_draws() -> dict:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3).tolist()
    return {
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": torch.rand(3).tolist(),
        "tracker": tracked,
    }


def weights(pol) -> dict:
    return {n: t.clone() for b in pol.iter_hf_buckets(1 << 30) for n, t in b}


def digest(w: dict) -> dict:
    """Bit patterns of every exported tensor (stage senders only hold theirs). On any device: the GPU
    tests (tests/gpu/trainer/test_async_checkpoint_gpu.py) hash CUDA tensors, which `.numpy()` refuses;
    `.cpu()` is a no-op on CPU tensors, so the CPU tests' digests are unchanged."""
    import hashlib

    return {
        n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in sorted(w.items())
    }


def phase_train_save(ctx: Ctx, tag: str) -> dict:
    from mlrl.trainer.rank.dist_ckpt import save_checkpoint
    from mlrl.trainer.rank.hf_export import export_hf

    a = ctx.policy()
    straight = [a.update(ctx.step_batches(a, k), pg_loss)["loss"] for k in range(4)]
    export_hf(a, ctx.work / f"{tag}_straight_hf")
    straight_digest = digest(weights(a))
    del a
    b = ctx.policy()
    first = [b.update(ctx.step_batches(b, k), pg_loss)["loss"] for k in range(2)]
    t0 = time.perf_counter()
    save_checkpoint(b, ctx.work / f"{tag}_fr")
    save_s = time.perf_counter() - t0
    save_checkpoint(b, ctx.work / f"{tag}_dpr", optim_sharding="dp_reshardable")
    export_hf(b, ctx.work / f"{tag}_step2_hf")  # what mcore-to-hf of {tag}_fr must reproduce
    return {"straight": straight, "first": first, "straight_digest": straight_digest, "save_s": save_s,
            "rng_after_save": rng_draws()}


def probe_batch(vocab: int):
    return make_step(vocab, n_samples=3, n_micro=1, seed=99)


def phase_resume(ctx: Ctx, tag: str) -> dict:
    from mlrl.trainer.rank.dist_ckpt import load_checkpoint
    from mlrl.trainer.rank.hf_export import export_hf

    pol = ctx.policy()
    t0 = time.perf_counter()
    info = load_checkpoint(pol, ctx.work / f"{tag}_fr")
    load_s = time.perf_counter() - t0
    draws = rng_draws()
    losses = [pol.update(ctx.step_batches(pol, k), pg_loss)["loss"] for k in (2, 3)]
    out = ctx.work / f"{tag}_resumed_{ctx.tag_layout}_hf"
    export_hf(pol, out)
    probe = probe_batch(pol.arch.vocab_size)
    logits = pol.compute_logits(probe)
    if ctx.ranks.rank == 0:
        torch.save({"logits": logits, "batch": probe}, ctx.work / f"{tag}_resumed_{ctx.tag_layout}_probe.pt")
    return {"info": info, "rng_after_load": draws, "losses": losses, "load_s": load_s, "digest": digest(weights(pol)),
            "optimizer_steps": pol.optimizer_steps, "lr": pol.optimizer.param_groups[0]["lr"]}


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the message is the result
        return f"{type(e).__name__}: {e}"
    return None


def phase_errors(ctx: Ctx, tag: str) -> dict:
    import shutil

    from mlrl.trainer.rank.dist_ckpt import load_checkpoint

    pol = ctx.policy()
    before = digest(weights(pol))
    out = {}
    src = ctx.work / f"{tag}_fr"
    out["missing"] = _error(lambda: load_checkpoint(pol, ctx.work / "no_such_checkpoint"))
    inc = ctx.work / f"{tag}_incomplete_{ctx.tag_layout}"
    if ctx.ranks.rank == 0:
        shutil.copytree(src, inc)
        (inc / "mlrl_checkpoint.json").unlink()
    dist.barrier()
    out["incomplete"] = _error(lambda: load_checkpoint(pol, inc))
    out["dp_reshardable_after_layout_change"] = _error(lambda: load_checkpoint(pol, ctx.work / f"{tag}_dpr"))
    other = ctx.policy(model="tiny-qwen3")
    out["architecture"] = _error(lambda: load_checkpoint(other, src))
    if ctx.args.other_model:
        wide = ctx.policy(model=ctx.args.other_model)
        out["hidden_size"] = _error(lambda: load_checkpoint(wide, src))
    out["untouched"] = digest(weights(pol)) == before
    return out


def phase_kill_save(ctx: Ctx, tag: str) -> dict:
    from megatron.core.dist_checkpointing import serialization

    from mlrl.checkpoint import CheckpointManager
    from mlrl.trainer.rank.dist_ckpt import save_checkpoint

    root = ctx.work / f"{tag}_run"
    manager = CheckpointManager(root, keep_last=2)
    pol = ctx.policy()
    pol.update(ctx.step_batches(pol, 0), pg_loss)
    tmp = manager.begin(1) if ctx.ranks.rank == 0 else None
    tmp = _bcast(tmp)
    save_checkpoint(pol, tmp / "model_optim")
    dist.barrier()
    if ctx.ranks.rank == 0:
        manager.commit(tmp, 1, {"weight_version": 1})
    pol.update(ctx.step_batches(pol, 1), pg_loss)
    tmp = manager.begin(2) if ctx.ranks.rank == 0 else None
    tmp = _bcast(tmp)

    def stall(*a, **k):  # every shard is written; Megatron's metadata.json is next
        (ctx.work / f"{tag}_saving_pid.{ctx.ranks.rank}").write_text(str(os.getpid()))  # torchrun starts us in
        (ctx.work / f"{tag}_saving.{ctx.ranks.rank}").write_text(str(tmp))             # our own session
        time.sleep(600)

    serialization.save_config = stall
    save_checkpoint(pol, tmp / "model_optim")
    return {"not_killed": True}


def phase_kill_resume(ctx: Ctx, tag: str) -> dict:
    from mlrl.checkpoint import CheckpointManager, read_state
    from mlrl.trainer.rank.dist_ckpt import load_checkpoint

    manager = CheckpointManager(ctx.work / f"{tag}_run", keep_last=2)
    ckpt = manager.resolve_resume("auto")
    pol = ctx.policy()
    info = load_checkpoint(pol, ckpt / "model_optim")
    loss = pol.update(ctx.step_batches(pol, 1), pg_loss)["loss"]
    killed = next(manager.root.glob(".tmp-step_000002-*")) / "model_optim"
    return {"resumed_from": ckpt.name, "state": read_state(ckpt), "info": info, "loss": loss,
            "load_killed": _error(lambda: load_checkpoint(pol, killed))}


def phase_async_save(ctx: Ctx, tag: str) -> dict:
    from mlrl.checkpoint import CheckpointManager
    from mlrl.ckpt_files.layout import META_FILE
    from mlrl.trainer.rank import dist_ckpt
    from mlrl.trainer.rank.dist_ckpt import finalize_async_saves, load_checkpoint, save_checkpoint

    manager = CheckpointManager(ctx.work / f"{tag}_async_run", keep_last=2)
    a = ctx.policy()
    for k in range(2):
        a.update(ctx.step_batches(a, k), pg_loss)
    at_save = digest(weights(a))
    tmp = _bcast(manager.begin(2) if ctx.ranks.rank == 0 else None)
    save_checkpoint(a, tmp / "model_optim", async_save=True)
    out = {"async_queue_used": dist_ckpt._ASYNC_QUEUE is not None,
           "meta_before_finalize": (tmp / "model_optim" / META_FILE).exists()}
    loss_a3 = a.update(ctx.step_batches(a, 2), pg_loss)["loss"]  # training goes on while the shards are written
    found = manager.resolve_resume("auto")
    out["resume_before_finalize"] = found.name if found else None
    out["pending_after_blocking_finalize"] = finalize_async_saves(blocking=True)
    out["meta_after_finalize"] = (tmp / "model_optim" / META_FILE).exists()
    dist.barrier()
    if ctx.ranks.rank == 0:
        manager.commit(tmp, 2, {"weight_version": 2})
    dist.barrier()
    ckpt = manager.resolve_resume("auto")
    b = ctx.policy()
    info = load_checkpoint(b, ckpt / "model_optim")
    resumed = digest(weights(b))
    loss_b3 = b.update(ctx.step_batches(b, 2), pg_loss)["loss"]
    return {
        **out,
        "resumed_from": ckpt.name,
        "info": info,
        "same_weights_as_at_save": resumed == at_save,
        "loss_a3": loss_a3,
        "loss_b3": loss_b3,
        "same_weights_after_step3": digest(weights(a)) == digest(weights(b)),
        "weights_compared": len(at_save),
    }


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


PHASES = {"train_save": phase_train_save, "resume": phase_resume, "errors": phase_errors,
          "kill_save": phase_kill_save, "kill_resume": phase_kill_resume, "async_save": phase_async_save}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--phases", required=True)
    ap.add_argument("--other-model", default=None, help="errors phase: a model of another hidden size")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        ctx = Ctx(args)
        for spec in args.phases.split(","):
            phase, _, ctx.phase_model = spec.partition("@")
            name, _, tag = phase.partition(":")
            t0 = time.perf_counter()
            results[spec] = PHASES[name](ctx, tag)
            results[spec]["phase_s"] = time.perf_counter() - t0
        results["ranks"] = ctx.ranks.as_dict()
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    from mlrl.trainer.rank.dist_ckpt import close_async_saves

    close_async_saves()  # async_save: stops megatron-core's writer process, which a rank's exit would wait for
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
