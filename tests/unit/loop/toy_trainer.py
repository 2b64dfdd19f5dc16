"""A bigram language model and a per-token value table in plain torch, driven through the same
seam as the Megatron trainer (`compute_logprobs` / `update` / `compute_values` on packed
micro-batches, with mlrl's real loss functions and metric reduction). It stands in for the
trainer next to the unit under test (mlrl.update.train_on: old logprobs, advantages,
mini-batches, epochs, critic updates); the Megatron side of the same seam is tested in
tests/integration/trainer and tests/integration/loop.
"""

from __future__ import annotations

import copy

import torch

from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.algorithms.losses import make_loss_fn
from mlrl.config import Config
from mlrl.experience.batch import MicroBatch
from mlrl.types import Sample

VOCAB = 12


def _bigram_logprobs(table: torch.Tensor, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob[t] = log softmax(table[tokens[t-1]] / T)[tokens[t]] inside each sample; 0 on the
    first token of a sample and on padding (the MicroBatch convention)."""
    tokens = mb.tokens
    prev = torch.cat([tokens[:1], tokens[:-1]])
    logits = table[prev] / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    first = torch.zeros_like(tokens, dtype=torch.bool)
    first[mb.cu_seqlens[:-1].long()] = True
    first |= mb.sample_ids < 0
    zero = torch.zeros_like(lp)
    return torch.where(first, zero, lp), torch.where(first, zero, ent)


class ToyPolicy:
    dp_size = 1

    def __init__(self, cfg: Config, seed: int = 0, optimizer: str = "sgd", lr: float = 2.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g) * 0.5)
        self.ref_table = self.table.detach().clone()
        self.opt = torch.optim.SGD([self.table], lr=lr) if optimizer == "sgd" else torch.optim.Adam([self.table], lr=lr)
        self.loss_fn = make_loss_fn(cfg.algorithm)
        self.temperature = cfg.rollout.sampling.temperature or 1.0
        self.calls: list[str] = []

    def compute_logprobs(self, per_dp, temperature, *, reference=False):
        self.calls.append("ref_logprobs" if reference else "old_logprobs")
        table = self.ref_table if reference else self.table.detach()
        return [[tuple(t.detach() for t in _bigram_logprobs(table, mb, temperature)) for mb in rank] for rank in per_dp]

    def update(self, per_dp):
        self.calls.append("update")
        self.opt.zero_grad()
        ms = []
        for mb in per_dp[0]:
            lp, ent = _bigram_logprobs(self.table, mb, self.temperature)
            loss, m = self.loss_fn(mb, lp, ent)
            loss.backward()
            ms.append({**m, "loss_tokens": mb.loss_mask.sum()})
        grad_norm = float(self.table.grad.norm())
        self.opt.step()
        out = finalize_loss_metrics(combine_loss_metrics(ms))
        return {**out, "grad_norm": grad_norm, "lr": self.opt.param_groups[0]["lr"]}

    def logprobs_of(self, samples: list[Sample], table: torch.Tensor | None = None) -> list[torch.Tensor]:
        from mlrl.experience.packing import pack_step, unpack_per_sample

        per_dp, _ = pack_step(samples, dp_size=1, token_budget=4096, loss_agg="token-mean")
        t = self.table.detach() if table is None else table
        out = [_bigram_logprobs(t, mb, self.temperature)[0] for mb in per_dp[0]]
        return unpack_per_sample(per_dp[0], out, len(samples))


class ToyCritic:
    """V(prefix before token t) = w[tokens[t-1]] (a value per previous token)."""

    def __init__(self, cfg: Config, lr: float = 0.5):
        from mlrl.algorithms.value import make_value_loss_fn

        self.w = torch.nn.Parameter(torch.zeros(VOCAB))
        self.opt = torch.optim.SGD([self.w], lr=lr)
        self.loss_fn = make_value_loss_fn(cfg.critic.value_clip)

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        tokens = mb.tokens
        prev = torch.cat([tokens[:1], tokens[:-1]])
        v = self.w[prev]
        first = torch.zeros_like(tokens, dtype=torch.bool)
        first[mb.cu_seqlens[:-1].long()] = True
        first |= mb.sample_ids < 0
        return torch.where(first, torch.zeros_like(v), v)

    def compute_values(self, per_dp):
        return [[self._values(mb).detach() for mb in rank] for rank in per_dp]

    def update(self, per_dp):
        self.opt.zero_grad()
        ms = []
        for mb in per_dp[0]:
            loss, m = self.loss_fn(mb, self._values(mb))
            loss.backward()
            ms.append({**m, "loss_tokens": mb.loss_mask.sum()})
        self.opt.step()
        return finalize_loss_metrics(combine_loss_metrics(ms))


def make_step(n_groups: int = 4, group_size: int = 4, seed: int = 0, rollout_noise: float = 0.3,
              policy: ToyPolicy | None = None) -> list[Sample]:
    """Groups of samples with varied rewards; rollout logprobs = the policy's own + noise (the
    train/rollout mismatch the IS corrections act on)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for gi in range(n_groups):
        prompt = torch.randint(0, VOCAB, (3,), generator=g).tolist()
        for k in range(group_size):
            n_resp = int(torch.randint(2, 7, (1,), generator=g))
            resp = torch.randint(0, VOCAB, (n_resp,), generator=g).tolist()
            tokens = prompt + resp
            mask = [0] * len(prompt) + [1] * n_resp
            reward = float((k + gi) % 2) if k < group_size - 1 else float(torch.rand(1, generator=g))
            samples.append(Sample(tokens=tokens, loss_mask=mask, rollout_logprobs=[0.0] * len(tokens),
                                  versions=[0] * len(tokens), reward=reward, prompt_len=len(prompt), group_id=f"g{gi}"))
    if policy is not None:
        for s, lp in zip(samples, policy.logprobs_of(samples)):
            noise = torch.randn(len(s.tokens), generator=g) * rollout_noise
            s.rollout_logprobs = [float(x + e) if m else 0.0 for x, e, m in zip(lp, noise, s.loss_mask)]
    return samples


def clone(samples: list[Sample]) -> list[Sample]:
    return copy.deepcopy(samples)
