"""Train/rollout mismatch correction (TIS, MIS token / sequence) and its metrics, by hand."""

import math

import pytest
import torch

from mlrl.algorithms.mismatch import mismatch_metrics, rollout_correction
from mlrl.algorithms.segments import segment_index

LN = math.log

# one packed row: seq0 = positions 0..2 (mask 0,1,1), seq1 = 3..5 (mask 0,1,1), padding at 6
# rho = exp(old - rollout) on the loss tokens: seq0 (3, .25), seq1 (1.2, 1)
MASK = torch.tensor([0, 1, 1, 0, 1, 1, 0])
OLD = torch.tensor([0.0, LN(3), LN(0.25), 0.0, LN(1.2), 0.0, 0.0], dtype=torch.float64)
ROLLOUT = torch.zeros(7, dtype=torch.float64)
ROLLOUT[0] = 5.0  # non-loss tokens must not matter
SEG = segment_index(torch.tensor([0, 3, 6], dtype=torch.int32), 7)


def close(t, values, tol=1e-6):
    assert torch.allclose(t.to(torch.float64), torch.tensor(values, dtype=torch.float64), atol=tol), (
        t.tolist(),
        values,
    )


def test_tis_truncates_at_cap():
    # w = min(rho, 2) = 2, .25, 1.2, 1 ; one of 4 tokens truncated
    w, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "tis", 2.0)
    close(w, [0, 2, 0.25, 0, 1.2, 1, 0])
    close(keep, [0, 1, 1, 0, 1, 1, 0])
    assert float(m["mismatch/clipped_frac"]) == 1.0  # a sum: 1 token (denominator n_tokens = 4)
    assert float(m["mismatch/is_weight_mean"]) == pytest.approx(2 + 0.25 + 1.2 + 1)


def test_mis_token_masks_tokens_outside_band():
    # band [1/2, 2]: rho 3 and .25 are out (masked), 1.2 and 1 are in (weight = rho)
    w, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "mis_token", 2.0)
    close(keep, [0, 0, 0, 0, 1, 1, 0])
    close(w * keep, [0, 0, 0, 0, 1.2, 1, 0])
    assert float(m["mismatch/masked_frac"]) == 2.0


def test_mis_seq_masks_whole_sequences():
    # seq0: rho = 3 * .25 = .75 (in [1/2, 2]) -> weight .75 on both tokens
    # seq1: rho = 1.2 * 1 = 1.2 (in)          -> weight 1.2
    w, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "mis_seq", 2.0, SEG, 2)
    close(w, [0, 0.75, 0.75, 0, 1.2, 1.2, 0])
    close(keep, [0, 1, 1, 0, 1, 1, 0])
    assert float(m["mismatch/seq_masked_frac"]) == 0.0
    # with cap 1.1 seq1 (1.2) is out and seq0 (.75 < 1/1.1 = .909) is out too
    w, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "mis_seq", 1.1, SEG, 2)
    close(keep, [0, 0, 0, 0, 0, 0, 0])
    assert float(m["mismatch/seq_masked_frac"]) == 2.0
    assert float(m["mismatch/masked_frac"]) == 4.0
    # cap 1.25: only seq0 is masked
    _, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "mis_seq", 1.25, SEG, 2)
    close(keep, [0, 0, 0, 0, 1, 1, 0])
    assert float(m["mismatch/seq_masked_frac"]) == 1.0
    with pytest.raises(ValueError, match="needs seg and num_seqs"):
        rollout_correction(OLD, ROLLOUT, MASK, "mis_seq", 2.0)


def test_gap_and_k3_metrics():
    # |old - rollout| on loss tokens: ln3 + ln4 + ln1.2 + 0 = 2.667228 (mean .666807)
    # k3 of KL(rollout || trainer) = rho - 1 - ln rho: .901388 + .636294 + .017678 + 0 = 1.555360 (mean .388840)
    _, _, m = rollout_correction(OLD, ROLLOUT, MASK, "none", 2.0)
    assert float(m["mismatch/logprob_gap"]) == pytest.approx(2.667228, abs=1e-5)
    assert float(m["mismatch/k3_kl"]) == pytest.approx(1.555360, abs=1e-5)
    f = mismatch_metrics(OLD, ROLLOUT, MASK)
    assert f["mismatch/logprob_gap"] == pytest.approx(0.666807, abs=1e-6)
    assert f["mismatch/logprob_gap_max"] == pytest.approx(LN(4))
    assert f["mismatch/k3_kl"] == pytest.approx(0.388840, abs=1e-6)


def test_weights_are_detached_and_modes_validated():
    old = OLD.clone().requires_grad_()
    w, keep, _ = rollout_correction(old, ROLLOUT, MASK, "tis", 2.0)
    assert not w.requires_grad and not keep.requires_grad
    with pytest.raises(ValueError, match="algorithm.rollout_is='is'"):
        rollout_correction(OLD, ROLLOUT, MASK, "is", 2.0)
    with pytest.raises(ValueError, match="rollout_is_cap=0.5"):
        rollout_correction(OLD, ROLLOUT, MASK, "tis", 0.5)


def test_icepop_masks_tokens_outside_its_own_bounds():
    # rho 3, .25, 1.2, 1: bounds [0.2, 2] keep .25, 1.2, 1 (mis_token with cap 2 would drop .25);
    # bounds [0.9, 1.1] keep only 1
    w, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "icepop", 2.0, bounds=(0.2, 2.0))
    close(keep, [0, 0, 1, 0, 1, 1, 0])
    close(w * keep, [0, 0, 0.25, 0, 1.2, 1, 0])
    assert float(m["mismatch/masked_frac"]) == 1.0
    _, keep, m = rollout_correction(OLD, ROLLOUT, MASK, "icepop", 2.0, bounds=(0.9, 1.1))
    close(keep, [0, 0, 0, 0, 0, 1, 0])
    assert float(m["mismatch/masked_frac"]) == 3.0
    with pytest.raises(ValueError, match="icepop_low / icepop_high = 2.0 / 0.5"):
        rollout_correction(OLD, ROLLOUT, MASK, "icepop", 2.0, bounds=(2.0, 0.5))
