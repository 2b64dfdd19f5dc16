"""Check a model's Megatron port against HF transformers: the check to run after adding a model.

    python tools/compare_hf_megatron.py --hf-dir DIR [--tp N] [--pp N] [--ep N] [--tol 1e-5] [--noise-floor] \
        [--random-tokens | --no-random-tokens]

Launches tp*pp*ep trainer processes itself (torchrun, gloo on CPU / NCCL on GPU), builds mlrl's
Megatron policy from DIR with that layout, runs it and HF transformers (fp32, one sample at a
time) on the same packed token sequences (chat prompts through the model's tokenizer), and
prints the max |difference| of logits and of token logprobs.

A folder without tokenizer files (a converted or randomly initialised checkpoint) is compared on
seeded random token ids in the vocabulary instead (`--random-tokens`, chosen by itself then and
said on stdout; `--no-random-tokens` makes it an input error).

Exit codes: 0 parity, 1 parity FAIL (above the bound), 2 usage or input error (found before any
rank starts: the folder, its config and weights, the layout, the tokenizer), 3 the comparison
did not complete (a rank crashed or --timeout passed; the ranks' output is above).

--noise-floor measures how far fp32 arithmetic itself is from the exact result, for a deep
model where 1e-5 is below fp32's own noise: HF in float64 serves as the exact reference, and
the tool reports |HF fp32 - HF fp64| (HF's floor), |Megatron fp32 - HF fp64|, and HF fp32 under
another reduction order (one right-padded batch instead of one sample at a time). Megatron is
at parity when its distance to the fp64 result is within 2x HF's own: the exit criterion
becomes max(tol, 2 * HF floor) applied to |Megatron - HF fp64|.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROMPTS = [
    "What is 12 + 7 ? Answer with a number .",
    "Repeat after me : a b c d e .",
    "The sum of 3 and 4 is 7 , and the sum of 5 and 6 is 11 .",
    "Write the digit that comes after 4 .",
    "Question : what is the reverse of 1 2 3 ? answer : 3 2 1 .",
]


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="HF model folder or builtin:<name>")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-5, help="max allowed |delta| of logits and logprobs")
    ap.add_argument("--noise-floor", action="store_true", help="also measure HF's own reduction-order noise")
    ap.add_argument("--samples", type=int, default=len(PROMPTS))
    ap.add_argument("--random-tokens", action=argparse.BooleanOptionalAction, default=None,
                    help="compare on seeded random token ids instead of tokenized prompts (default: only when the "
                         "folder has no tokenizer)")
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    ap.add_argument("--timeout", type=float, default=900)
    return ap.parse_args(argv)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
OK, FAIL, INPUT_ERROR, INCOMPLETE = 0, 1, 2, 3


def has_tokenizer(hf_dir: Path) -> bool:
    return any((hf_dir / name).is_file() for name in TOKENIZER_FILES)


def _precheck(args) -> str | None:
    """The bridge's config / layout / checkpoint checks and the tokenizer, before any process is
    started; sets args.random_tokens when it was left to the tool."""
    from mlrl.bridge import BridgeError, HFCheckpoint, check_layout, spec_for
    from mlrl.modelzoo import hf_config_dict, resolve_model_dir

    for name in ("tp", "pp", "ep", "samples"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    try:
        hf_dir = resolve_model_dir(args.hf_dir, field="--hf-dir")
        spec, arch = spec_for(hf_config_dict(str(hf_dir), field="--hf-dir"))  # a broken config.json is named
        check_layout(arch, tp=args.tp, pp=args.pp, ep=args.ep)
        HFCheckpoint(hf_dir).check(spec, arch)
    except (BridgeError, ValueError) as e:
        return str(e)
    if not has_tokenizer(hf_dir):
        if args.random_tokens is False:
            return (f"{hf_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}): drop --no-random-tokens to compare "
                    "on random token ids, or add the tokenizer files")
        if args.random_tokens is None:
            print(f"compare_hf_megatron: {hf_dir} has no tokenizer: comparing on seeded random token ids "
                  "(--random-tokens)", flush=True)
        args.random_tokens = True
    return None


def launch(args) -> int:
    error = _precheck(args)
    if error:
        print(f"compare_hf_megatron: {error}", file=sys.stderr)
        return INPUT_ERROR
    world = args.tp * args.pp * args.ep
    argv = [a for a in sys.argv[1:] if a not in ("--random-tokens", "--no-random-tokens")]
    argv.append("--random-tokens" if args.random_tokens else "--no-random-tokens")
    scratch = Path(tempfile.mkdtemp(prefix="compare_hf_megatron."))  # rank 0's verdict; removed whatever happens
    try:
        return _run_ranks(args, world, argv, scratch / "result.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_ranks(args, world: int, argv: list[str], result: Path) -> int:
    from mlrl.procs import kill_tree, torchrun_command

    cmd = torchrun_command(world, __file__, *argv)
    env = dict(os.environ, MLRL_COMPARE_WORKER="1", MLRL_COMPARE_RESULT=str(result),
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        print(f"compare_hf_megatron: timed out after {args.timeout:.0f} s", file=sys.stderr)
        return INCOMPLETE
    except KeyboardInterrupt:
        kill_tree(proc.pid)
        raise
    res = json.loads(result.read_text()) if result.exists() else None
    if res is None:  # rank 0 never wrote its verdict: a rank failed (its traceback is above)
        print(f"compare_hf_megatron: the comparison did not complete (ranks exited {proc.returncode})",
              file=sys.stderr)
        return INCOMPLETE
    return OK if res["ok"] else FAIL


def _random_samples(vocab_size: int, n: int):
    """n sequences of 8-40 token ids in [0, vocab_size), the same for every run (seed 0)."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 41, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (k,), generator=g) for k in lengths]


def _samples(hf_dir: Path, n: int):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for text in (PROMPTS * ((n + len(PROMPTS) - 1) // len(PROMPTS)))[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True) \
            if tok.chat_template else tok(text)["input_ids"]
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(torch.tensor(list(ids), dtype=torch.long))
    return out


def _micro_batch(samples):
    import torch

    from mlrl.experience.batch import MicroBatch

    lens = [len(s) for s in samples]
    S = sum(lens)
    z = torch.zeros(S)
    return MicroBatch(
        tokens=torch.cat(samples), position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        sample_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]),
        loss_mask=z, loss_weight=z, advantages=z, rollout_logprobs=z)


def _hf_logits(model, samples, batched: bool):
    import torch

    with torch.no_grad():
        if not batched:
            return [model(s[None]).logits[0] for s in samples]
        L = max(len(s) for s in samples)
        ids = torch.zeros(len(samples), L, dtype=torch.long)
        mask = torch.zeros(len(samples), L, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        logits = model(ids, attention_mask=mask).logits
        return [logits[i, : len(s)] for i, s in enumerate(samples)]


def _token_logprobs(logits, s):
    import torch

    return torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]


def _max_diff(a_list, b_list, samples, cu) -> tuple[float, float]:
    """(max |d logits|, max |d token logprob|) between two lists of per-sample logits (the
    first list may also be one packed [S, V] tensor, cut by cu)."""
    if not isinstance(a_list, list):
        a_list = [a_list[a:b] for a, b in zip(cu, cu[1:])]
    d_logits = max(float((a.double() - b.double()).abs().max()) for a, b in zip(a_list, b_list))
    d_lp = max(float((_token_logprobs(a.double(), s) - _token_logprobs(b.double(), s)).abs().max())
               for a, b, s in zip(a_list, b_list, samples))
    return d_logits, d_lp


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
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = args.tp, args.pp, args.ep
    cfg.cluster.trainer_devices = args.tp * args.pp * args.ep  # dp = ep (room for the expert groups)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    is_moe = bool(hf_config.get("num_experts") or hf_config.get("num_local_experts"))
    cfg.parallel.sequence_parallel = is_moe and args.tp > 1
    layout = resolve_layout(cfg)
    init_parallel(cfg.parallel, layout, seed=cfg.trainer.seed)
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=hf_dir, trainable=False)
    samples = _random_samples(hf_config["vocab_size"], args.samples) if args.random_tokens else \
        _samples(hf_dir, args.samples)
    mb = _micro_batch(samples)
    logits = policy.compute_logits([mb])[0]
    (logprobs, _), = policy.compute_logprobs([mb], temperature=1.0)
    rc = 0
    if dist.get_rank() == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ref = _hf_logits(model, samples, batched=False)
        cu = mb.cu_seqlens.tolist()
        d_logits, d_lp = _max_diff(logits, ref, samples, cu)
        # the logprobs Megatron's own (vocab-parallel) path computes, vs HF's log_softmax
        d_lp_path = max(
            float((logprobs[a + 1 : b] - _token_logprobs(r, s)).abs().max())
            for a, b, r, s in zip(cu, cu[1:], ref, samples)
        )
        res = {"hf_dir": str(hf_dir), "tp": args.tp, "pp": args.pp, "ep": args.ep, "tokens": int(mb.num_tokens),
               "inputs": "random token ids" if args.random_tokens else "tokenized prompts",
               "max_abs_logits": d_logits, "max_abs_logprob": max(d_lp, d_lp_path)}
        measured = max(d_logits, d_lp, d_lp_path)
        bound = args.tol
        if args.noise_floor:
            exact = _hf_logits(model.double(), samples, batched=False)
            model.float()
            res["hf_fp32_vs_fp64_logits"], res["hf_fp32_vs_fp64_logprob"] = _max_diff(ref, exact, samples, cu)
            res["megatron_vs_fp64_logits"], res["megatron_vs_fp64_logprob"] = _max_diff(logits, exact, samples, cu)
            res["hf_batched_vs_single_logits"], res["hf_batched_vs_single_logprob"] = _max_diff(
                _hf_logits(model, samples, batched=True), ref, samples, cu)
            floor = max(res["hf_fp32_vs_fp64_logits"], res["hf_fp32_vs_fp64_logprob"])
            bound = max(args.tol, 2 * floor)
            measured = max(res["megatron_vs_fp64_logits"], res["megatron_vs_fp64_logprob"])
        res["bound"] = bound
        res["ok"] = measured <= bound
        line = (f"compare_hf_megatron: {hf_dir.name} tp={args.tp} pp={args.pp} ep={args.ep} tokens={res['tokens']}: "
                f"Megatron vs HF fp32: max|d logits|={d_logits:.3e} max|d logprob|={res['max_abs_logprob']:.3e}")
        if args.noise_floor:
            line += (
                f"; vs HF fp64: Megatron {res['megatron_vs_fp64_logits']:.3e} / {res['megatron_vs_fp64_logprob']:.3e}, "
                f"HF fp32 {res['hf_fp32_vs_fp64_logits']:.3e} / {res['hf_fp32_vs_fp64_logprob']:.3e} (logits / "
                "logprob); "
                f"HF batched vs single {res['hf_batched_vs_single_logits']:.3e} / "
                f"{res['hf_batched_vs_single_logprob']:.3e}"
            )
        print(line + f" -> {'OK' if res['ok'] else 'FAIL'} (bound {bound:.1e})", flush=True)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res))
        if os.environ.get("MLRL_COMPARE_RESULT"):  # the launcher's verdict file
            Path(os.environ["MLRL_COMPARE_RESULT"]).write_text(json.dumps(res))
        rc = OK if res["ok"] else FAIL
    flag = torch.tensor([rc])
    dist.broadcast(flag, src=0)
    dist.barrier()
    dist.destroy_process_group()
    return int(flag.item())


def main(argv=None) -> int:
    args = _parse(argv)
    if os.environ.get("MLRL_COMPARE_WORKER") == "1":
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
