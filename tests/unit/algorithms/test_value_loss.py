"""The critic's clipped value loss and explained variance against hand-worked values."""

import math

import pytest
import torch

from mlrl.algorithms.value import explained_variance, make_value_loss_fn
from mlrl.experience.batch import MicroBatch
from mlrl.experience.packing import attach_per_sample


def micro_batch(values_garbage=5.0):
    """Position 0 is a prompt token (loss_mask 0) holding garbage; three loss tokens:
    t1 V=1.0  old=0.5 R=2.0: V outside old+-0.2, V_clip=0.7: (0.7-2)^2=1.69 > (1-2)^2=1  -> clipped term
    t2 V=1.0  old=0.0 R=0.5: V outside the range, V_clip=0.2: (0.2-.5)^2=.09 < (1-.5)^2=.25 -> unclipped
    t3 V=-0.1 old=0.0 R=0.3: V inside the range: both terms equal (0.4^2=0.16)"""
    S = 4
    mb = MicroBatch(
        tokens=torch.arange(S), position_ids=torch.arange(S), cu_seqlens=torch.tensor([0, S], dtype=torch.int32),
        sample_ids=torch.zeros(S, dtype=torch.int64), loss_mask=torch.tensor([0.0, 1, 1, 1]),
        loss_weight=torch.tensor([0.0, 0.5, 0.25, 0.25]), advantages=torch.zeros(S), rollout_logprobs=torch.zeros(S))
    attach_per_sample([mb], "old_values", [torch.tensor([0.0, 0.5, 0.0, 0.0])])
    attach_per_sample([mb], "returns", [torch.tensor([0.0, 2.0, 0.5, 0.3])])
    values = torch.tensor([values_garbage, 1.0, 1.0, -0.1], dtype=torch.float64, requires_grad=True)
    return mb, values


def test_clipped_value_loss_hand_computed():
    mb, v = micro_batch(values_garbage=float("inf"))  # a masked position may hold anything
    loss, m = make_value_loss_fn(0.2)(mb, v)
    # 0.5 * (0.5 * 1.69 + 0.25 * 0.25 + 0.25 * 0.16)
    assert float(loss.detach()) == pytest.approx(0.5 * 0.845 + 0.25 * 0.125 + 0.25 * 0.08, abs=1e-7)
    loss.backward()
    # t1: the clipped term is chosen and V is outside the range -> no gradient; t2, t3: w * (V - R)
    assert v.grad.tolist() == pytest.approx([0.0, 0.0, 0.25 * 0.5, 0.25 * -0.4], abs=1e-7)
    assert float(m["value_loss"]) == pytest.approx(0.47375, abs=1e-7)
    assert float(m["value_clipfrac"]) == 1.0 and float(m["n_tokens"]) == 3.0
    assert float(m["values"]) == pytest.approx(1.9, abs=1e-6) and float(m["returns"]) == pytest.approx(2.8, abs=1e-6)
    assert all(t.dim() == 0 for t in m.values())


def test_unclipped_value_loss_differs_and_ignores_old_values():
    mb, v = micro_batch()
    loss, m = make_value_loss_fn(0.0)(mb, v)
    assert float(loss.detach()) == pytest.approx(0.5 * 0.5 + 0.25 * 0.125 + 0.25 * 0.08, abs=1e-7)  # 0.30125
    assert float(loss.detach()) != pytest.approx(float(make_value_loss_fn(0.2)(*micro_batch())[0].detach()))
    assert float(m["value_clipfrac"]) == 0.0
    loss.backward()
    assert v.grad.tolist() == pytest.approx([0.0, 0.5 * -1.0, 0.25 * 0.5, 0.25 * -0.4], abs=1e-7)
    mb.old_values = None  # not needed without clipping
    assert float(make_value_loss_fn(0.0)(mb, v)[0].detach()) == pytest.approx(0.30125, abs=1e-7)


def test_wide_clip_range_equals_unclipped():
    mb, v = micro_batch()
    assert float(make_value_loss_fn(100.0)(mb, v)[0].detach()) == pytest.approx(
        float(make_value_loss_fn(0.0)(mb, v)[0].detach()), abs=1e-7
    )


def test_loss_adds_up_over_a_split():
    """Per-token loss times the step-wide weights: two halves of a row sum to the whole."""
    mb, v = micro_batch()
    fn = make_value_loss_fn(0.2)
    whole = float(fn(mb, v)[0].detach())
    parts = 0.0
    for keep in (torch.tensor([1.0, 1, 0, 0]), torch.tensor([0.0, 0, 1, 1])):
        part, _ = micro_batch()
        part.loss_mask, part.loss_weight = mb.loss_mask * keep, mb.loss_weight * keep
        parts += float(fn(part, v)[0].detach())
    assert parts == pytest.approx(whole, abs=1e-7)


def test_missing_inputs_are_named():
    mb, v = micro_batch()
    mb.old_values = None
    with pytest.raises(ValueError, match="old_values is None but critic.value_clip=0.2"):
        make_value_loss_fn(0.2)(mb, v)
    mb.returns = None
    with pytest.raises(ValueError, match="returns is None"):
        make_value_loss_fn(0.0)(mb, v)
    with pytest.raises(ValueError, match="critic.value_clip=-1"):
        make_value_loss_fn(-1)


def test_explained_variance():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    assert explained_variance(r.clone(), r, mask) == 1.0                       # perfect critic
    assert explained_variance(torch.zeros(5), r, mask) == 0.0                   # constant prediction
    # R - V = [0, 0, 0, -1]: Var = 0.25 - 0.0625 = 0.1875; Var[R] = 1.25 -> 1 - 0.15
    v = torch.tensor([1.0, 2.0, 3.0, 5.0, -7.0])
    assert explained_variance(v, r, mask.bool()) == pytest.approx(0.85, abs=1e-7)
    assert explained_variance(-r, r, mask) == pytest.approx(-3.0, abs=1e-7)   # worse than the mean: negative
    assert math.isnan(explained_variance(v, torch.ones(5), mask))              # constant returns: undefined
    assert math.isnan(explained_variance(v, r, torch.zeros(5)))                # no token
