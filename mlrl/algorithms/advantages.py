"""Advantage estimators: how the rewards of a step become the advantages the policy loss multiplies.

Each estimator is a pure function of tensors with its formula in the docstring. Group estimators
(GRPO, Dr.GRPO, RLOO) give one advantage per sample; token estimators (REINFORCE++, GAE) give one
per token, on a [N, T] grid right-padded per sample, where `mask` [N, T] marks the policy tokens
(Sample.loss_mask). Non-policy tokens inside a response (tool output in multi-turn) are skipped by
the token recursions: the return of a policy token flows to the next *policy* token.

`compute_advantages` is the only function here that touches Samples. It always fills
`Sample.advantage` (sequence level); token estimators also store the per-token advantages
([T] list, 0.0 on non-policy tokens) under `Sample.metadata[TOKEN_ADVANTAGES_KEY]`, which the
packer (mlrl.experience.packing) prefers over broadcasting Sample.advantage. Group estimators
remove that key so a sample never carries stale token advantages.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence, Union, cast

import torch

from mlrl.algorithms.kl import kl_reward_penalty
from mlrl.config.schema import AlgorithmConfig
from mlrl.types import RETURNS_KEY, TOKEN_ADVANTAGES_KEY, Sample  # the keys are re-exported

GroupIds = Union[torch.Tensor, Sequence[Hashable]]


def _group_index(group_ids: GroupIds, n: int) -> tuple[torch.Tensor, int]:
    """Dense group index [N] in 0..G-1 and G."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (n,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({n},) like rewards")
        _, idx = torch.unique(group_ids, return_inverse=True)
        return idx.to(torch.int64), int(idx.max()) + 1 if n else 0
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries, expected {n} (one per reward)")
    dense: dict[Hashable, int] = {}
    idx = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.int64), len(dense)


def _group_stats(
    rewards: torch.Tensor, idx: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std (0 for groups of one) and group size."""
    counts = torch.bincount(idx, minlength=num_groups).to(rewards.dtype)
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, idx, rewards) / counts
    dev = rewards - mean[idx]
    var = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, idx, dev * dev) / (counts - 1).clamp(min=1)
    return mean[idx], var.sqrt()[idx], counts[idx]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: GroupIds, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, outcome supervision): [N] -> [N].

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     with std_normalize
        A_i =  r_i - mean_g(r)                         without (Dr.GRPO)

    g is the group of sample i (the samples of one prompt); std is the unbiased (Bessel) group std,
    as in TRL and verl. A group of one sample has no baseline: its advantage is 0.
    """
    rewards = rewards.to(torch.float64)
    idx, g = _group_index(group_ids, rewards.numel())
    mean, std, _ = _group_stats(rewards, idx, g)
    adv = rewards - mean
    if std_normalize:
        adv = adv / (std + eps)
    return adv.to(torch.float32)


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i - mean_g(r).

    Dr.GRPO removes both of GRPO's biases. The std division is removed here. The other, the
    1/|y_i| length normalisation, is not an advantage property: it is the loss aggregation. Use
    `algorithm.loss_agg = "seq-mean-token-sum-norm"` (sum of token losses divided by a constant
    length, see mlrl.algorithms.losses.loss_agg_weights) to get the paper's objective.
    """
    return grpo_advantages(rewards, group_ids, std_normalize=False)


def rloo_advantages(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline within each group of K samples.

        A_i = r_i - 1/(K-1) * sum_{j != i} r_j  =  K/(K-1) * (r_i - mean_g(r))

    A group of one sample has no baseline: its advantage is 0.
    """
    rewards = rewards.to(torch.float64)
    idx, g = _group_index(group_ids, rewards.numel())
    mean, _, k = _group_stats(rewards, idx, g)
    adv = torch.where(k > 1, k / (k - 1).clamp(min=1) * (rewards - mean), torch.zeros_like(rewards))
    return adv.to(torch.float32)


def outcome_token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl_penalty: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Token rewards [N, T] from outcome rewards [N]: r_t = kl_penalty_t (0 if None) on policy
    tokens, plus R_i on the last policy token of sample i. kl_penalty is already signed and scaled
    (see mlrl.algorithms.kl.kl_reward_penalty). A sample without policy tokens gets nothing."""
    mask = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    if kl_penalty is not None:
        out = torch.where(mask, kl_penalty.to(torch.float64), out)
    t = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, t, torch.full_like(t, -1)).max(dim=1).values  # [N], -1 if no policy token
    has = last >= 0
    rows = torch.arange(mask.shape[0])[has]
    out[rows, last[has]] += rewards.to(torch.float64)[has]
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} over policy tokens, t' the next policy token (G = 0 after the
    last one); 0 on non-policy tokens. [N, T] -> [N, T]."""
    mask = mask > 0
    rewards = token_rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return out


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl_penalty: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): [N] outcome rewards -> [N, T] token advantages.

        r_t = -beta * kl_t  (+ R_i on the last policy token)      kl_penalty = -beta * kl_t
        G_t = sum over later policy tokens s of gamma^(s - t) r_s  (discounted_returns)
        A_t = (G_t - mean_B(G)) / (std_B(G) + eps)

    mean_B / std_B run over every policy token of the batch (global batch normalisation replaces
    the critic and the group baseline); std is unbiased. 0 on non-policy tokens.
    """
    m = mask > 0
    g = discounted_returns(outcome_token_rewards(rewards, m, kl_penalty), m, gamma)
    vals = g[m]
    if vals.numel() == 0:
        return torch.zeros(m.shape, dtype=torch.float32)
    mean = vals.mean()
    std = vals.std(unbiased=True) if vals.numel() > 1 else torch.zeros((), dtype=vals.dtype)
    return torch.where(m, (g - mean) / (std + eps), torch.zeros_like(g)).to(torch.float32)


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over policy tokens: ([N, T] advantages, [N, T] returns).

        delta_t = r_t + gamma * V_{t'} - V_t     (t' the next policy token; V = 0 after the last)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                      (the critic's regression target)

    Both outputs are 0 on non-policy tokens. No whitening is applied (PPO recipes that whiten do
    it afterwards).
    """
    m = mask > 0
    r = token_rewards.to(torch.float64)
    v = values.to(torch.float64)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(m[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(m[:, t], v[:, t], next_value)
        adv[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv.to(torch.float32), returns.to(torch.float32)


# --------------------------------------------------------------------------- samples -> advantages

GroupEstimator = Callable[[torch.Tensor, list[str], AlgorithmConfig], torch.Tensor]
TokenEstimator = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], AlgorithmConfig],
                          tuple[torch.Tensor, Optional[torch.Tensor]]]

GROUP_ESTIMATORS: dict[str, GroupEstimator] = {
    "grpo": lambda r, g, cfg: grpo_advantages(r, g, std_normalize=cfg.std_normalize),
    "dr_grpo": lambda r, g, cfg: dr_grpo_advantages(r, g),
    "rloo": lambda r, g, cfg: rloo_advantages(r, g),
}
def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the entries where mask is true (var unbiased, as verl's
    masked_whiten); 0 elsewhere."""
    m = mask > 0
    vals = x[m].to(torch.float64)
    if vals.numel() < 2:
        return torch.where(m, x - vals.mean() if vals.numel() else x, torch.zeros_like(x)).to(torch.float32)
    out = (x.to(torch.float64) - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + eps)
    return torch.where(m, out, torch.zeros_like(out)).to(torch.float32)


def _gae(r, m, klp, v, cfg):
    adv, ret = gae_advantages(outcome_token_rewards(r, m, klp), v, m, cfg.gamma, cfg.lam)
    return (whiten(adv, m) if cfg.std_normalize else adv), ret


# (rewards [N], mask [N, T], kl_penalty [N, T] | None, values [N, T] | None, cfg)
#     -> ([N, T] advantages, [N, T] returns | None)
# gae whitens its advantages over the step's policy tokens when algorithm.std_normalize (PPO's usual
# recipe, verl's masked_whiten); the returns are computed before whitening.
TOKEN_ESTIMATORS: dict[str, TokenEstimator] = {
    "reinforce_pp": lambda r, m, klp, v, cfg: (reinforce_pp_advantages(r, m, klp, gamma=cfg.gamma), None),
    "gae": _gae,
}


def _pad(rows: Sequence[Sequence[float]] | Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """[N, length] float64, row i = rows[i] then zeros. One copy of the concatenated rows (a step
    has hundreds of samples), not one per row."""
    out = torch.zeros(len(rows), length, dtype=torch.float64)
    if not rows:
        return out
    if isinstance(rows[0], torch.Tensor):
        parts = [cast(torch.Tensor, r).reshape(-1).to(torch.float64) for r in rows]
        flat = torch.cat(parts)
        lens = torch.tensor([p.numel() for p in parts])
    else:
        flat = torch.tensor([float(x) for r in rows for x in r], dtype=torch.float64)
        lens = torch.tensor([len(r) for r in rows])
    out[torch.arange(length) < lens[:, None]] = flat  # row-major: the rows' values in order
    return out


def _check_per_sample(name: str, tensors: Sequence[torch.Tensor], samples: Sequence[Sample]) -> None:
    if len(tensors) != len(samples):
        raise ValueError(f"{name}: {len(tensors)} tensors for {len(samples)} samples")
    for i, (t, s) in enumerate(zip(tensors, samples)):
        if t.numel() != len(s.tokens):
            raise ValueError(f"{name}[{i}] has {t.numel()} values, expected len(samples[{i}].tokens)={len(s.tokens)}")


def compute_advantages(
    samples: Sequence[Sample],
    algo_cfg: AlgorithmConfig,
    *,
    ref_logprobs: Optional[Sequence[torch.Tensor]] = None,
    policy_logprobs: Optional[Sequence[torch.Tensor]] = None,
    values: Optional[Sequence[torch.Tensor]] = None,
) -> None:
    """Fill `Sample.advantage` (and token advantages for reinforce_pp / gae) for one step, in place.

    Pass only trainable samples (failed ones would shift group baselines). Per-sample tensors are
    [T_i], aligned with Sample.tokens:
    - ref_logprobs: required when algo_cfg.kl_in_reward and kl_coef > 0. The KL of the policy to
      the reference (estimator algo_cfg.kl_estimator) is then folded into the reward: per token
      for token estimators; for group estimators as r_i - kl_coef * sum_t kl_t before the group
      statistics (a sequence-level penalty; departure: GRPO's paper puts the KL in the loss).
    - policy_logprobs: the policy side of that KL (default: the samples' rollout logprobs).
    - values: critic values, required by gae.
    """
    name = algo_cfg.advantage
    if name not in GROUP_ESTIMATORS and name not in TOKEN_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage={name!r}: expected one of {sorted(GROUP_ESTIMATORS) + sorted(TOKEN_ESTIMATORS)}"
        )
    if not samples:
        return
    t_max = max(len(s.tokens) for s in samples)
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
    mask = _pad([s.loss_mask for s in samples], t_max) > 0

    kl_pen = None
    if algo_cfg.kl_in_reward and algo_cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(
                "compute_advantages: algorithm.kl_in_reward with kl_coef > 0 needs ref_logprobs (one [T] tensor per "
                "sample)"
            )
        _check_per_sample("ref_logprobs", ref_logprobs, samples)
        pol = policy_logprobs if policy_logprobs is not None else [torch.tensor(s.rollout_logprobs) for s in samples]
        _check_per_sample("policy_logprobs", pol, samples)
        kl_pen = kl_reward_penalty(
            _pad(pol, t_max), _pad(ref_logprobs, t_max), mask, algo_cfg.kl_coef, algo_cfg.kl_estimator
        )

    if name in GROUP_ESTIMATORS:
        r = rewards if kl_pen is None else rewards + kl_pen.sum(dim=1)
        adv = GROUP_ESTIMATORS[name](r, [s.group_id for s in samples], algo_cfg)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
            s.metadata.pop(TOKEN_ADVANTAGES_KEY, None)
        return

    v = None
    if name == "gae":
        if values is None:
            raise ValueError(
                "compute_advantages: algorithm.advantage='gae' needs values (one [T] critic tensor per sample)"
            )
        _check_per_sample("values", values, samples)
        v = _pad(values, t_max)
    tok, returns = TOKEN_ESTIMATORS[name](rewards, mask, kl_pen, v, algo_cfg)
    for i, s in enumerate(samples):
        row = tok[i, : len(s.tokens)]
        m = mask[i, : len(s.tokens)]
        s.metadata[TOKEN_ADVANTAGES_KEY] = row.tolist()
        if returns is not None:
            s.metadata[RETURNS_KEY] = returns[i, : len(s.tokens)].tolist()
        s.advantage = float(row[m].mean()) if bool(m.any()) else 0.0
