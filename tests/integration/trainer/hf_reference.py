"""HF-transformers references for the trainer checks (imported by the torchrun worker).

Micro-batches here follow mlrl.experience.batch: samples packed back to back, padding at the
end, loss_weight = loss_mask / (loss tokens of the whole step).
"""

from __future__ import annotations

import torch

from mlrl.experience.batch import MicroBatch


def make_samples(vocab: int, n: int, seed: int, min_len: int = 4, max_len: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(min_len, max_len + 1, (1,), generator=g)),), generator=g)
        for _ in range(n)
    ]


def pack(
    samples: list[torch.Tensor], sample_ids: list[int], total_loss_tokens: int, seed: int, pad: int = 3
) -> MicroBatch:
    """One packed row; the second half of each sample is the 'response' (loss_mask 1); the
    advantage of a sample depends only on (seed, sample id), not on the packing."""
    lens = [len(s) for s in samples]
    S = sum(lens) + pad
    tokens = torch.cat(samples + [torch.zeros(pad, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(pad, dtype=torch.long)])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    sid = torch.cat([torch.full((n,), i) for i, n in zip(sample_ids, lens)] + [torch.full((pad,), -1)])
    mask = torch.zeros(S)
    adv = torch.zeros(S)
    for a, n, i in zip(cu.tolist(), lens, sample_ids):
        mask[a + n // 2: a + n] = 1.0
        adv[a:a + n] = torch.randn((), generator=torch.Generator().manual_seed(seed * 1000 + i))
    weight = mask / total_loss_tokens
    return MicroBatch(tokens, pos, cu, sid, mask, weight, adv, torch.zeros(S))


def make_step(vocab: int, n_samples: int, n_micro: int, seed: int) -> list[MicroBatch]:
    """The same samples (and loss weights) packed into n_micro micro-batches."""
    samples = make_samples(vocab, n_samples, seed)
    total = sum(len(s) - len(s) // 2 for s in samples)
    per = [list(range(i, n_samples, n_micro)) for i in range(n_micro)]
    return [pack([samples[i] for i in idx], idx, total, seed=seed) for idx in per]


def pg_loss(mb: MicroBatch, lp: torch.Tensor, ent: torch.Tensor):
    """A policy-gradient loss with an entropy bonus, pre-normalised by loss_weight. Metrics: the
    weighted entropy (a sum) and the step's largest / smallest loss-token logprob (`_max` / `_min`
    keys: reduced by max / min over micro-batches and DP ranks, whatever the split)."""
    loss = -(mb.loss_weight * (mb.advantages * lp + 0.1 * ent)).sum()
    on = mb.loss_mask.bool()
    lp_d = lp.detach()
    return loss, {"entropy": (mb.loss_weight * ent).sum().detach(),
                  "lp_max": torch.where(on, lp_d, torch.full_like(lp_d, float("-inf"))).max(),
                  "lp_min": torch.where(on, lp_d, torch.full_like(lp_d, float("inf"))).min()}


def hf_row(model, mb: MicroBatch, temperature: float, *, grad: bool = False):
    """(logprobs [S], entropy [S], [logits of each sample]) for a packed row, one sample at a time."""
    S = mb.num_tokens
    lp = torch.zeros(S)
    ent = torch.zeros(S)
    logits_all = []
    t = temperature if temperature > 0 else 1.0
    cu = mb.cu_seqlens.tolist()
    lp_parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        with torch.set_grad_enabled(grad):
            logits = model(mb.tokens[a:b][None]).logits[0].float()
        logits_all.append(logits.detach())
        logp = torch.log_softmax(logits[:-1] / t, dim=-1)
        lp_parts.append((a, b, logp.gather(-1, mb.tokens[a + 1:b, None])[:, 0], -(logp.exp() * logp).sum(-1)))
    if grad:
        lp_list, ent_list, prev = [], [], 0
        for a, b, lp_ab, e in lp_parts:
            lp_list += [torch.zeros(a + 1 - prev), lp_ab]
            ent_list += [torch.zeros(a + 1 - prev), e]
            prev = b
        lp_list.append(torch.zeros(S - prev))
        ent_list.append(torch.zeros(S - prev))
        return torch.cat(lp_list), torch.cat(ent_list), logits_all
    for a, b, lp_ab, e in lp_parts:
        lp[a + 1:b] = lp_ab
        ent[a + 1:b] = e
    return lp, ent, logits_all


def checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps MoE experts fused in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); the checkpoint (and the bridge) name them per expert."""
    out = {}
    for n, t in tensors.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[n] = t
    return out


def hf_loss_and_grads(model, micro_batches: list[MicroBatch], temperature: float = 1.0):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro_batches:
        lp, ent, _ = hf_row(model, mb, temperature, grad=True)
        loss, _ = pg_loss(mb, lp, ent)
        loss.backward()
        total += float(loss)
    return total, checkpoint_names(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    )


def reference_lr(k: int, lr: float, warmup: int) -> float:
    """mlrl's schedule for optimizer step k (1-based), constant after a linear warm-up."""
    return lr * min(1.0, k / warmup) if warmup else lr


def hf_adamw_steps(model, steps: list[list[MicroBatch]], *, lr: float, warmup: int, weight_decay: float, clip: float,
                   betas=(0.9, 0.999), eps=1e-8):
    """Plain torch AdamW with Megatron's conventions: no weight decay on 1-D params and biases,
    global-norm clipping, schedule `reference_lr`."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        eps=eps,
    )
    for k, mbs in enumerate(steps, start=1):
        for group in opt.param_groups:
            group["lr"] = reference_lr(k, lr, warmup)
        hf_loss_and_grads(model, mbs)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return checkpoint_names({n: p.detach() for n, p in model.named_parameters()})
