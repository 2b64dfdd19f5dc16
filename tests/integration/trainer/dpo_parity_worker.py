"""torchrun worker for test_dpo_parity.py: the DPO / IPO loss and gradients of the Megatron policy
against a plain PyTorch DPO on the Hugging Face model, under several parallel layouts in ONE launch
(2 ranks), fp32.

The batch: real preference pairs for builtin:tiny-llama through `get_dataset(..., "dpo")` (synthetic
tasks with answers of 1, 2 and 4 tokens and long arith_word prompts; the rejected side is another
row's answer) plus one pair in TRL's standard string format. The reference logprobs come from a
perturbed copy of the HF model (so that policy != reference and the loss is not log 2); both sides
get the same ones, computed once in plain PyTorch.

Megatron side, per layout (`ref` = tp1 / dp2, `tp2`, `pp2`): the DPO driver's own packing
(`mlrl.jobs.dpo.pack_pairs`, a token budget giving >= 2 micro-batches per DP rank) -> ref_logprobs
attached per sample -> `policy.update(make_dpo_loss_fn(beta, type), step=False)` -> loss
(summed over micro-batches and DP ranks: the step's mean over pairs) and the gradients in HF names.

Reference (every rank): for each pair and side, log_softmax of the HF logits gathered at the next
token, summed over the completion mask (IPO: averaged); h = (pi_c - ref_c) - (pi_r - ref_r); loss
= mean over pairs of -logsigmoid(beta h) (IPO: (h - 1/(2 beta))^2); `.backward()`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from critic_worker import Phase

TOKEN_BUDGET = 64
BETA = 0.5
TASKS = {"arith_word": 2, "copy_digit": 2, "copy_pair": 2, "reverse_digits": 2}


def pairs(tokenizer) -> list[dict]:
    from mlrl.data.preference import preference_example
    from mlrl.data.registry import get_dataset

    out = []
    for task, n in TASKS.items():
        out += get_dataset(f"synthetic:{task}", "train", "dpo", tokenizer, max_length=TOKEN_BUDGET // 2,
                           num_rows=n).examples
    chosen, rejected = preference_example(tokenizer, {"prompt": "add 3 4", "chosen": "7", "rejected": "8 9"}, "s")
    return out + [{"chosen": chosen, "rejected": rejected}]


def side_logprobs(model, side) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1 of one sequence (differentiable), [T-1]."""
    ids = torch.tensor(side[0])
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


def reference_tokens(ref_model, examples) -> list[torch.Tensor]:
    """Per sample ([chosen_0, rejected_0, ...]) the reference's token-aligned logprobs [T] (first 0)."""
    out = []
    with torch.no_grad():
        for p in examples:
            for side in ("chosen", "rejected"):
                out.append(torch.cat([torch.zeros(1), side_logprobs(ref_model, p[side])]))
    return out


def plain_dpo(model, examples, ref_tokens, loss_type: str) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    losses = []
    for k, p in enumerate(examples):
        ratio = []
        for j, side in enumerate(("chosen", "rejected")):
            mask = torch.tensor(p[side][1][1:], dtype=torch.float32)
            pol = (side_logprobs(model, p[side]) * mask).sum()
            ref = (ref_tokens[2 * k + j][1:] * mask).sum()
            if loss_type == "ipo":
                pol, ref = pol / mask.sum(), ref / mask.sum()
            ratio.append(pol - ref)
        h = ratio[0] - ratio[1]
        losses.append(-F.logsigmoid(BETA * h) if loss_type == "sigmoid" else (h - 1 / (2 * BETA)) ** 2)
    loss = torch.stack(losses).mean()
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def megatron_dpo(policy, examples, ref_tokens, dp_rank: int, dp_size: int, loss_type: str) -> dict:
    from mlrl.algorithms.dpo_loss import make_dpo_loss_fn
    from mlrl.experience.packing import attach_per_sample
    from mlrl.jobs.dpo import pack_pairs

    per_dp, _ = pack_pairs(examples, dp_size, TOKEN_BUDGET)
    mine = per_dp[dp_rank]
    attach_per_sample(mine, "ref_logprobs", ref_tokens)
    m = policy.update(mine, make_dpo_loss_fn(BETA, loss_type), temperature=1.0, step=False)
    grads = {n: t.clone().cpu() for b in policy.iter_hf_buckets(1 << 30, grads=True) for n, t in b}
    return {"loss": m["loss"], "pairs": m["n_pairs"], "margin": m["reward_margin"], "accuracy": m["reward_accuracy"],
            "micro_batches": len(mine), "grads": grads}


def layout_phase(name: str, examples, ref_tokens, hf_grads: dict) -> dict:
    from trainer_worker import build_cfg

    from mlrl.trainer.rank.policy import MegatronPolicy

    t0 = time.perf_counter()
    ph = Phase("tiny-llama", name)
    cfg, layout = build_cfg(ph.args, optimizer="sgd", total_steps=10, use_distributed_optimizer=False, grad_clip=0.0)
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=ph.hf_dir, trainable=True)
    r = ph.ranks
    res: dict = {"ranks": r.as_dict()}
    for loss_type in ("sigmoid", "ipo"):
        got = megatron_dpo(policy, examples, ref_tokens, r.dp, r.dp_size, loss_type)
        grads = got.pop("grads")
        ref = hf_grads[loss_type]
        got["grad_err"] = max((float((g - ref[n]).abs().max()) for n, g in grads.items()), default=0.0)
        got["grad_names"] = sorted(grads)
        res[loss_type] = got
    res["time_s"] = time.perf_counter() - t0
    del policy
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="ref,tp2,pp2")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        import transformers

        from mlrl.modelzoo import resolve_model_dir
        from mlrl.workflow import load_hf_tokenizer

        tokenizer = load_hf_tokenizer("builtin:tiny-llama")
        examples = pairs(tokenizer)
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin:tiny-llama"),
                                                               dtype=torch.float32).eval()
        ref_model = copy.deepcopy(hf)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        ref_tokens = reference_tokens(ref_model, examples)
        hf_losses, hf_grads = {}, {}
        for loss_type in ("sigmoid", "ipo"):
            hf_losses[loss_type], hf_grads[loss_type] = plain_dpo(hf, examples, ref_tokens, loss_type)
        results["hf"] = {"loss": hf_losses, "names": sorted(hf_grads["sigmoid"]),
                         "grad_max": {k: max(float(v.abs().max()) for v in g.values()) for k, g in hf_grads.items()},
                         "lengths": [[len(p[s][0]) for s in ("chosen", "rejected")] for p in examples]}
        for name in filter(None, args.layouts.split(",")):
            results[name] = layout_phase(name, examples, ref_tokens, hf_grads)
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
