"""Tokens/s of mlrl's Megatron train step vs a Hugging Face transformers train step, same model,
same batch, measured side by side in one run; prints the ratio.

    python tools/bench_train_step.py --hf-dir builtin:smollm2-135m-instruct [--tp N] [--pp N] \
        [--samples 16] [--sample-len 128] [--micro-batches 2] [--steps 3]

Both sides do the full step: forward, token logprobs + entropy, a policy-gradient loss
normalised over the step, backward, grad clipping, AdamW. Megatron runs the packed
micro-batches through `MegatronPolicy.train_step` (tp*pp processes, launched here with
torchrun); HF runs on rank 0 afterwards with the samples of each micro-batch as one unpadded
batch (all samples have the same length, so neither side wastes work on padding), with as many
threads as the Megatron ranks had together. The first `--warmup` steps of each side are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16, help="samples per step")
    ap.add_argument("--sample-len", type=int, default=128, help="tokens per sample")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    world = args.tp * args.pp
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, *sys.argv[1:]]
    env = dict(os.environ, MLRL_BENCH_WORKER="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(proc.pid, 9)
        return 2


def _batch(vocab: int, args):
    import torch

    from mlrl.experience.batch import MicroBatch

    g = torch.Generator().manual_seed(0)
    n, L = args.samples, args.sample_len
    samples = torch.randint(3, vocab, (n, L), generator=g)
    adv = torch.randn(n, generator=g)
    loss_tokens = n * (L - L // 2)
    mbs = []
    for idx in torch.arange(n).chunk(args.micro_batches):
        k = len(idx)
        mask = torch.zeros(k, L)
        mask[:, L // 2:] = 1.0
        mbs.append(MicroBatch(
            tokens=samples[idx].reshape(-1), position_ids=torch.arange(L).repeat(k),
            cu_seqlens=torch.arange(0, (k + 1) * L, L, dtype=torch.int32), sample_ids=idx.repeat_interleave(L),
            loss_mask=mask.reshape(-1), loss_weight=mask.reshape(-1) / loss_tokens,
            advantages=adv[idx].repeat_interleave(L), rollout_logprobs=torch.zeros(k * L)))
    return samples, mbs


def pg_loss(mb, lp, ent):
    loss = -(mb.loss_weight * (mb.advantages * lp + 0.01 * ent)).sum()
    return loss, {}


def _hf_step(model, opt, mbs, L, clip):
    import torch

    opt.zero_grad(set_to_none=True)
    for mb in mbs:
        ids = mb.tokens.view(-1, L)
        logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = torch.zeros(ids.shape)
        ent = torch.zeros(ids.shape)
        lp = torch.cat([lp[:, :1], logp.gather(-1, ids[:, 1:, None])[..., 0]], dim=1)
        ent = torch.cat([ent[:, :1], -(logp.exp() * logp).sum(-1)], dim=1)
        loss, _ = pg_loss(mb, lp.reshape(-1), ent.reshape(-1))
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import transformers

    from mlrl.config.schema import Config
    from mlrl.config.validate import resolve_layout
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

    hf_dir = resolve_model_dir(args.hf_dir)
    cfg = Config()
    cfg.model.hf_dir = str(hf_dir)
    cfg.parallel.tp, cfg.parallel.pp = args.tp, args.pp
    cfg.trainer.lr, cfg.trainer.grad_clip = 1e-6, 1.0
    cfg.trainer.total_steps = args.steps + args.warmup
    layout = resolve_layout(cfg)
    init_parallel(cfg.parallel, layout, seed=0)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    samples, mbs = _batch(vocab, args)
    tokens = samples.numel()

    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=hf_dir, trainable=True)
    for _ in range(args.warmup):
        policy.train_step(mbs, pg_loss)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        policy.train_step(mbs, pg_loss)
    dist.barrier()
    mg_time = (time.perf_counter() - t0) / args.steps
    del policy

    rc = 0
    if dist.get_rank() == 0:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for _ in range(args.warmup):
            _hf_step(model, opt, mbs, args.sample_len, 1.0)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            _hf_step(model, opt, mbs, args.sample_len, 1.0)
        hf_time = (time.perf_counter() - t0) / args.steps
        res = {"hf_dir": str(hf_dir), "tp": args.tp, "pp": args.pp, "tokens_per_step": tokens,
               "micro_batches": args.micro_batches, "megatron_tokens_per_s": tokens / mg_time,
               "hf_tokens_per_s": tokens / hf_time, "ratio_megatron_over_hf": hf_time / mg_time,
               "torch_threads_hf": torch.get_num_threads(), "megatron_ranks": dist.get_world_size()}
        print(f"bench_train_step: {hf_dir.name} tp={args.tp} pp={args.pp}, {tokens} tokens/step "
              f"({args.samples} x {args.sample_len}, {args.micro_batches} micro-batches): Megatron "
              f"{res['megatron_tokens_per_s']:.0f} tok/s, HF {res['hf_tokens_per_s']:.0f} tok/s, "
              f"ratio Megatron/HF = {res['ratio_megatron_over_hf']:.2f}", flush=True)
        print(json.dumps(res), flush=True)
        print(f"ratio megatron_over_hf: {res['ratio_megatron_over_hf']:.3f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return rc


def main(argv=None) -> int:
    args = _parse(argv)
    if os.environ.get("MLRL_BENCH_WORKER") == "1":
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
