"""torchrun worker for test_sft_parity.py: the SFT loss of the Megatron policy against Hugging Face's
causal-LM loss on the same batch, under several parallel layouts in ONE launch (2 ranks).

The batch is real SFT data for builtin:tiny-llama: synthetic rows through `get_dataset(..., "sft")`
(arith_word: long prompts, 27-32 tokens; copy_digit / add_digits: 9-10 tokens; every answer is one
word then the template's " ."), plus one hand-built conversation with two assistant turns of several
tokens each, so that its loss mask has two separate spans.

Megatron side, per layout (`ref` = tp1 / dp2, `tp2` = tp2 / dp1, `tp2+sp`): the batch goes through
the SFT driver's own path (`mlrl.jobs.sft.samples_of` -> `pack_step(loss_agg="token-mean")` with a token
budget giving >= 2 micro-batches per DP rank -> `policy.update(sft_loss, step=False)`) and
metrics["loss"] (summed over micro-batches and DP ranks) is the step's token-mean NLL. The
multi-turn conversation alone is a second step.

HF side (rank 0): AutoModelForCausalLM in fp32 on the same folder, one conversation at a time with
labels = input_ids where the mask is 1 else -100. `.loss` is that conversation's mean over its
labelled tokens; the batch reference recombines those means with the token counts, and is checked
against a direct log_softmax sum over all masked tokens.

Each rank writes `<out>/rank<r>.json`; assertions live in test_sft_parity.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from critic_worker import Phase

TOKEN_BUDGET = 48  # tokens per micro-batch: ~250 tokens in the batch -> >= 2 micro-batches per DP rank
SYNTHETIC = {"arith_word": 5, "copy_digit": 4, "add_digits": 3}  # task -> conversations taken
MULTI_TURN = [
    {"role": "user", "content": "add 3 4"},
    {"role": "assistant", "content": "3 + 4 = 7"},
    {"role": "user", "content": "what is the sum of 2 and 5 ?"},
    {"role": "assistant", "content": "the answer is 7"},
]


def conversations(tokenizer) -> list[dict[str, list[int]]]:
    """The batch: synthetic SFT examples of varying length, then the multi-turn conversation (last)."""
    from mlrl.data.chat_tokens import tokenize_messages
    from mlrl.data.registry import get_dataset

    out = []
    for task, n in SYNTHETIC.items():
        out += get_dataset(f"synthetic:{task}", "train", "sft", tokenizer, max_length=TOKEN_BUDGET, num_rows=n).examples
    ids, mask = tokenize_messages(tokenizer, MULTI_TURN)
    return out + [{"input_ids": ids, "loss_mask": mask}]


def mask_spans(tokenizer, ex: dict[str, list[int]]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    spans, cur = [], []
    for t, m in zip(ex["input_ids"], ex["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tokenizer.decode(s) for s in spans]


def hf_reference(hf_dir: Path, examples: list[dict[str, list[int]]]) -> dict:
    """Per conversation: HF's `.loss` and its number of labelled tokens; the batch loss both as the
    token-count-weighted mean of those and as a direct log_softmax sum."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    losses, counts, nll = [], [], 0.0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor(ex["input_ids"])
            mask = torch.tensor(ex["loss_mask"], dtype=torch.bool)
            labels = torch.where(mask, ids, torch.full_like(ids, -100))
            out = model(input_ids=ids[None], labels=labels[None])
            losses.append(float(out.loss))
            counts.append(int(mask[1:].sum()))  # HF shifts: token t is predicted from tokens < t
            lp = torch.log_softmax(out.logits[0, :-1].double(), -1).gather(-1, ids[1:, None])[:, 0]
            nll -= float(lp[mask[1:]].sum())
    total = sum(counts)
    return {"losses": losses, "counts": counts, "batch_loss": sum(x * n for x, n in zip(losses, counts)) / total,
            "batch_loss_logsoftmax": nll / total, "loss_tokens": total}


def megatron_loss(policy, examples: list[dict[str, list[int]]], dp_rank: int, dp_size: int) -> dict:
    """The SFT driver's path for one step, without the optimizer update."""
    from mlrl.algorithms.sft_loss import sft_loss
    from mlrl.experience.packing import pack_step
    from mlrl.jobs.sft import samples_of

    per_dp, pack = pack_step(samples_of(examples), dp_size=dp_size, token_budget=TOKEN_BUDGET, loss_agg="token-mean")
    m = policy.update(per_dp[dp_rank], sft_loss, temperature=1.0, step=False)
    return {"loss": m["loss"], "loss_tokens": m["loss_tokens"], "micro_batches": len(per_dp[dp_rank]),
            "pack_loss_tokens": pack["pack/num_loss_tokens"]}


def layout_phase(name: str, examples: list[dict[str, list[int]]]) -> dict:
    from trainer_worker import build_cfg

    from mlrl.trainer.rank.policy import MegatronPolicy

    t0 = time.perf_counter()
    ph = Phase("tiny-llama", name)
    cfg, layout = build_cfg(ph.args, optimizer="sgd", total_steps=10, use_distributed_optimizer=False)
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=ph.hf_dir, trainable=True)
    r = ph.ranks
    res = {"batch": megatron_loss(policy, examples, r.dp, r.dp_size),
           "single": megatron_loss(policy, examples[-1:], r.dp, r.dp_size),
           "ranks": r.as_dict(), "time_s": time.perf_counter() - t0}
    del policy
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="ref,tp2,tp2+sp")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank = int(os.environ.get("RANK", "0"))
    results: dict = {}
    try:
        from mlrl.modelzoo import resolve_model_dir
        from mlrl.workflow import load_hf_tokenizer

        tokenizer = load_hf_tokenizer("builtin:tiny-llama")
        examples = conversations(tokenizer)
        results["lengths"] = [len(e["input_ids"]) for e in examples]
        results["mask_spans"] = mask_spans(tokenizer, examples[-1])
        results["multi_turn_contents"] = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
        if rank == 0:
            t0 = time.perf_counter()
            results["hf"] = hf_reference(resolve_model_dir("builtin:tiny-llama"), examples)
            results["hf"]["time_s"] = time.perf_counter() - t0
        for name in filter(None, args.layouts.split(",")):
            results[name] = layout_phase(name, examples)
    except Exception:
        results["error"] = traceback.format_exc()
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        raise
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
