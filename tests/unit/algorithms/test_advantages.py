"""Advantage estimators against small examples worked by hand (the arithmetic is in comments)."""

import math

import pytest
import torch

from mlrl.algorithms.advantages import (
    TOKEN_ADVANTAGES_KEY,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mlrl.config.schema import AlgorithmConfig
from mlrl.types import Sample


def approx(t, values, tol=1e-5):
    assert torch.allclose(t.to(torch.float64), torch.tensor(values, dtype=torch.float64), atol=tol), (
        t.tolist(),
        values,
    )


# group "a" = [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350
#   -> A = +-0.5 / 0.577350 = +-0.866025
# group "b" = [2, 2]: std 0 -> A = 0 / (0 + eps) = 0;  group "c" = [5] alone -> 0
REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.0, 2.0, 1.0, 5.0])
GROUPS = ["a", "b", "a", "a", "b", "a", "c"]


def test_grpo_hand_computed():
    approx(grpo_advantages(REWARDS, GROUPS), [0.866025, 0, -0.866025, -0.866025, 0, 0.866025, 0])


def test_grpo_accepts_tensor_group_ids():
    ids = torch.tensor([7, 3, 7, 7, 3, 7, 9])
    assert torch.equal(grpo_advantages(REWARDS, ids), grpo_advantages(REWARDS, GROUPS))


def test_grpo_without_std_and_dr_grpo():
    # a: r - 0.5 = [0.5, -0.5, -0.5, 0.5]; b: r - 2 = 0; c: 0
    expected = [0.5, 0, -0.5, -0.5, 0, 0.5, 0]
    approx(grpo_advantages(REWARDS, GROUPS, std_normalize=False), expected)
    approx(dr_grpo_advantages(REWARDS, GROUPS), expected)


def test_rloo_hand_computed():
    # group [3, 1, 2]: baselines (1+2)/2 = 1.5, (3+2)/2 = 2.5, (3+1)/2 = 2 -> A = 1.5, -1.5, 0
    # group [4, 0]: baselines 0 and 4 -> A = 4, -4; singleton [7] -> 0
    r = torch.tensor([3.0, 4.0, 1.0, 2.0, 0.0, 7.0])
    g = ["x", "y", "x", "x", "y", "z"]
    approx(rloo_advantages(r, g), [1.5, 4.0, -1.5, 0.0, -4.0, 0.0])


def test_group_ids_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="group_ids has 2 entries, expected 3"):
        grpo_advantages(torch.zeros(3), ["a", "b"])


def test_outcome_rewards_and_discounted_returns():
    # mask [0,1,0,1]: tool token at t=2 is skipped; R=1 on the last policy token (t=3)
    mask = torch.tensor([[0, 1, 0, 1]])
    kl_pen = torch.tensor([[9.0, -0.1, 9.0, -0.2]])  # values on non-policy tokens must be ignored
    r = outcome_token_rewards(torch.tensor([1.0]), mask, kl_pen)
    approx(r, [[0, -0.1, 0, 0.8]])
    # gamma 0.5: G3 = 0.8, G1 = -0.1 + 0.5 * 0.8 = 0.3 (the tool token does not discount)
    approx(discounted_returns(r, mask, gamma=0.5), [[0, 0.3, 0, 0.8]])


def test_reinforce_pp_hand_computed():
    # sample 0: mask [0,1,1], kl [0,.1,.2], R=1, beta=.5 -> r = [_, -.05, -.1+1=.9] -> G = [_, .85, .9]
    # sample 1: mask [0,1,0], kl [0,.4,0],  R=0          -> r = [_, -.2]          -> G = [_, -.2]
    # batch of returns {.85, .9, -.2}: mean .516667, unbiased var .385833, std .621155
    # A = (.333333, .383333, -.716667) / .621155 = .536635, .617130, -1.153765
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    kl = torch.tensor([[0.0, 0.1, 0.2], [0.0, 0.4, 0.0]])
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, kl_penalty=-0.5 * kl, gamma=1.0)
    approx(a, [[0, 0.536635, 0.617130], [0, -1.153765, 0]])


def test_gae_hand_computed():
    # gamma .9, lam .5, V = [_, .5, .6, .7], reward 1 at t=3:
    # d3 = 1 - .7 = .3                 A3 = .3
    # d2 = .9*.7 - .6 = .03            A2 = .03 + .45*.3 = .165
    # d1 = .9*.6 - .5 = .04            A1 = .04 + .45*.165 = .11425
    # returns = A + V = [_, .61425, .765, 1.0]
    mask = torch.tensor([[0, 1, 1, 1]])
    v = torch.tensor([[0.0, 0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(outcome_token_rewards(torch.tensor([1.0]), mask), v, mask, gamma=0.9, lam=0.5)
    approx(adv, [[0, 0.11425, 0.165, 0.3]])
    approx(ret, [[0, 0.61425, 0.765, 1.0]])


def test_gae_skips_non_policy_tokens():
    # mask [0,1,0,1], V(t=2) = 9 is a tool token and must not enter the recursion:
    # A3 = 1 - .7 = .3;  d1 = .9*.7 - .5 = .13, A1 = .13 + .45*.3 = .265
    mask = torch.tensor([[0, 1, 0, 1]])
    v = torch.tensor([[0.0, 0.5, 9.0, 0.7]])
    adv, _ = gae_advantages(outcome_token_rewards(torch.tensor([1.0]), mask), v, mask, gamma=0.9, lam=0.5)
    approx(adv, [[0, 0.265, 0, 0.3]])


def _sample(reward, group, n_prompt=1, n_resp=2, lp=-1.0):
    n = n_prompt + n_resp
    return Sample(
        tokens=list(range(n)),
        loss_mask=[0] * n_prompt + [1] * n_resp,
        rollout_logprobs=[0.0] * n_prompt + [lp] * n_resp,
        versions=[-1] * n_prompt + [0] * n_resp,
        reward=reward,
        prompt_len=n_prompt,
        group_id=group,
    )


def test_compute_advantages_fills_sample_advantage():
    samples = [_sample(1.0, "a"), _sample(0.0, "a"), _sample(3.0, "b"), _sample(1.0, "b"), _sample(2.0, "b")]
    samples[0].metadata[TOKEN_ADVANTAGES_KEY] = [9.0] * 3  # stale: must be removed
    compute_advantages(samples, AlgorithmConfig(advantage="rloo"))
    # a: [1,0] -> +-1 ; b: [3,1,2] -> 1.5, -1.5, 0
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, 1.5, -1.5, 0.0])
    assert TOKEN_ADVANTAGES_KEY not in samples[0].metadata
    compute_advantages(samples, AlgorithmConfig(advantage="grpo", std_normalize=False))
    # a: mean .5 -> .5, -.5; b: mean 2 -> 1, -1, 0
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, 1.0, -1.0, 0.0])


def test_compute_advantages_kl_in_reward_for_group_estimator():
    # policy = rollout logprobs -1 on 2 response tokens; ref = -1 - ln 2 -> d = ln 2, k1 = .693147 per token
    # penalised rewards: 1 - .1*2*.693147 = .861371 and 0 - .138629 = -.138629 -> Dr.GRPO: +-.5 (shift cancels)
    # second group has different penalties: ref for sample 3 equal to policy (kl 0):
    #   r = [1 - .138629, 1 - 0] = [.861371, 1] -> mean .930685 -> A = -.069315, +.069315
    samples = [_sample(1.0, "a"), _sample(0.0, "a"), _sample(1.0, "b"), _sample(1.0, "b")]
    ref_shift = torch.tensor([0.0, math.log(2), math.log(2)])
    ref = [torch.tensor([0.0, -1.0, -1.0]) - ref_shift] * 3 + [torch.tensor([0.0, -1.0, -1.0])]
    cfg = AlgorithmConfig(advantage="dr_grpo", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    compute_advantages(samples, cfg, ref_logprobs=ref)
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, -0.069315, 0.069315], abs=1e-5)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        compute_advantages(samples, cfg)


def test_compute_advantages_token_estimators_store_token_advantages():
    samples = [_sample(1.0, "a", n_prompt=1, n_resp=2), _sample(0.0, "a", n_prompt=1, n_resp=1)]
    compute_advantages(samples, AlgorithmConfig(advantage="reinforce_pp"))
    # returns {1, 1, 0}: mean 2/3, unbiased std = sqrt((2*(1/9) + 4/9)/2) = .577350
    # A = (1/3)/.577350 = .577350 for sample 0's tokens, (-2/3)/.577350 = -1.154701 for sample 1's
    assert samples[0].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, 0.577350, 0.577350], abs=1e-5)
    assert samples[1].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, -1.154701], abs=1e-5)
    assert samples[0].advantage == pytest.approx(0.577350, abs=1e-5)
    with pytest.raises(ValueError, match="gae.*needs values"):
        compute_advantages(samples, AlgorithmConfig(advantage="gae"))
    compute_advantages(samples, AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, std_normalize=False),
                       values=[torch.zeros(3), torch.zeros(2)])
    # V = 0, gamma = lam = 1: A_t = R on every policy token
    assert samples[0].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, 1.0, 1.0])
    assert samples[1].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, 0.0])


def test_gae_with_gamma_lam_one_is_monte_carlo_return_minus_value():
    """Outcome reward at the last token, gamma = lam = 1: A_t = R - V_t (the Monte-Carlo return of
    every token is the reward), returns R_t = R; whitening (std_normalize) centres and scales A."""
    from mlrl.algorithms.advantages import RETURNS_KEY

    def step():
        return [_sample(1.0, "a", n_prompt=1, n_resp=2), _sample(0.0, "a", n_prompt=1, n_resp=1)]

    values = [torch.tensor([9.0, 0.3, 0.6]), torch.tensor([9.0, 0.2])]  # prompt values are never used
    raw = step()
    compute_advantages(raw, AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, std_normalize=False), values=values)
    assert raw[0].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, 0.7, 0.4])
    assert raw[1].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, -0.2])
    assert raw[0].metadata[RETURNS_KEY] == pytest.approx([0.0, 1.0, 1.0])
    assert raw[1].metadata[RETURNS_KEY] == pytest.approx([0.0, 0.0])
    white = step()
    compute_advantages(white, AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, std_normalize=True), values=values)
    # [0.7, 0.4, -0.2]: mean 0.3, unbiased std sqrt(0.21) = 0.458258
    assert white[0].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, 0.872872, 0.218218], abs=1e-5)
    assert white[1].metadata[TOKEN_ADVANTAGES_KEY] == pytest.approx([0.0, -1.091089], abs=1e-5)
    assert white[0].metadata[RETURNS_KEY] == pytest.approx([0.0, 1.0, 1.0])  # targets are not whitened


def test_compute_advantages_rejects_unknown_estimator():
    cfg = AlgorithmConfig()
    cfg.advantage = "nope"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="algorithm.advantage='nope'"):
        compute_advantages([_sample(1.0, "a")], cfg)


def test_pad_puts_each_ragged_row_first_then_zeros():
    from mlrl.algorithms.advantages import _pad

    rows = [[1, 2, 3], [], [4.5]]
    want = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 0], [4.5, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(_pad(rows, 4), want)
    assert torch.equal(_pad([torch.tensor(r, dtype=torch.float32) for r in rows], 4), want)
    assert _pad([], 3).shape == (0, 3)
