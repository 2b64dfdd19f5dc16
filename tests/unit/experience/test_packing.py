"""pack_step: exact small cases, packing invariants (hypothesis), per-sample <-> per-token maps."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlrl.algorithms.advantages import TOKEN_ADVANTAGES_KEY
from mlrl.experience.packing import attach_per_sample, gather_per_sample, pack_step, unpack_per_sample
from mlrl.types import Sample


def make_sample(length, n_prompt=1, advantage=0.0, seed=0):
    n_prompt = min(n_prompt, length)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, 1000, (length,), generator=g).tolist()
    lps = (-torch.rand(length, generator=g)).tolist()
    mask = [0] * n_prompt + [1] * (length - n_prompt)
    return Sample(
        tokens=toks,
        loss_mask=mask,
        rollout_logprobs=[lp if m else 0.0 for lp, m in zip(lps, mask)],
        versions=[0 if m else -1 for m in mask],
        advantage=advantage,
        prompt_len=n_prompt,
    )


def flat(packed):
    return [mb for rank in packed for mb in rank]


def test_first_fit_decreasing_exact():
    # budget 10, lengths 6 5 4 3 2 -> FFD: bin0 = {6, 4}, bin1 = {5, 3, 2}
    samples = [make_sample(n) for n in (3, 6, 2, 5, 4)]
    packed, m = pack_step(samples, dp_size=1, token_budget=10, loss_agg="token-mean")
    assert [mb.sample_ids.unique_consecutive().tolist() for mb in packed[0]] == [[1, 4], [0, 2, 3]]
    assert m["pack/micro_batches_per_rank"] == 2.0 and m["pack/padding_frac"] == 0.0


def test_dp_balance_lpt_exact():
    # lengths 8..1 over 2 ranks, longest first to the lighter rank: r0 = 8+5+4+1, r1 = 7+6+3+2 (18 each)
    samples = [make_sample(n) for n in (8, 7, 6, 5, 4, 3, 2, 1)]
    packed, m = pack_step(samples, dp_size=2, token_budget=32, loss_agg="token-mean")
    assert sorted(int(i) for mb in packed[0] for i in mb.sample_ids.unique() if i >= 0) == [0, 3, 4, 7]
    assert sorted(int(i) for mb in packed[1] for i in mb.sample_ids.unique() if i >= 0) == [1, 2, 5, 6]
    assert (m["pack/tokens_per_rank_min"], m["pack/tokens_per_rank_max"], m["pack/rank_imbalance"]) == (18.0, 18.0, 1.0)


def test_equal_micro_batch_counts_with_padding_only_batches():
    # 3 samples of 8 over 2 ranks, budget 8: rank0 has 2 micro-batches, rank1 1 + one padding-only
    samples = [make_sample(8, advantage=1.0) for _ in range(3)]
    packed, m = pack_step(samples, dp_size=2, token_budget=8, loss_agg="token-mean", pad_multiple=4)
    assert [len(r) for r in packed] == [2, 2]
    empty = packed[1][1]
    assert empty.num_samples == 0 and empty.num_tokens == 4
    assert empty.cu_seqlens.tolist() == [0]
    assert (empty.sample_ids == -1).all() and empty.loss_weight.sum() == 0 and empty.loss_mask.sum() == 0
    assert m["pack/padding_frac"] == pytest.approx(4 / 28)


def test_fields_of_a_micro_batch():
    a = make_sample(4, n_prompt=2, advantage=0.5, seed=1)
    b = make_sample(3, n_prompt=1, advantage=-2.0, seed=2)
    b.metadata[TOKEN_ADVANTAGES_KEY] = [9.0, 1.0, 2.0]  # token advantages win over the broadcast
    (mbs,), _ = pack_step([a, b], dp_size=1, token_budget=12, loss_agg="token-mean", pad_multiple=4, pad_token_id=7)
    mb = mbs[0]
    assert mb.tokens.tolist() == a.tokens + b.tokens + [7]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.cu_seqlens.dtype == torch.int32
    assert mb.sample_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1, 0]
    # token-mean over 4 loss tokens
    assert mb.loss_weight.tolist() == [0, 0, 0.25, 0.25, 0, 0.25, 0.25, 0]
    assert mb.advantages.tolist() == [0, 0, 0.5, 0.5, 0, 1.0, 2.0, 0]
    assert torch.allclose(mb.rollout_logprobs, torch.tensor(a.rollout_logprobs + b.rollout_logprobs + [0.0]))
    assert mb.old_logprobs is None and mb.ref_logprobs is None


def test_errors_are_clear():
    samples = [make_sample(4), make_sample(9)]
    with pytest.raises(ValueError, match=r"samples\[1\] has 9 tokens, more than token_budget=8"):
        pack_step(samples, dp_size=1, token_budget=8, loss_agg="token-mean")
    with pytest.raises(ValueError, match="token_budget=10.*multiple of pad_multiple=4"):
        pack_step(samples, dp_size=1, token_budget=10, loss_agg="token-mean", pad_multiple=4)
    with pytest.raises(ValueError, match="dp_size=0"):
        pack_step(samples, dp_size=0, token_budget=16, loss_agg="token-mean")
    with pytest.raises(ValueError, match="loss_agg='sum'"):
        pack_step(samples, dp_size=1, token_budget=16, loss_agg="sum")
    with pytest.raises(ValueError, match="no samples"):
        pack_step([], dp_size=1, token_budget=16, loss_agg="token-mean")


def test_unpack_attach_round_trip_and_errors():
    samples = [make_sample(n, seed=n) for n in (5, 3, 7, 2, 6)]
    packed, _ = pack_step(samples, dp_size=2, token_budget=8, loss_agg="token-mean", pad_multiple=2)
    mbs = flat(packed)
    per_sample = [torch.arange(len(s.tokens), dtype=torch.float32) + 100 * i for i, s in enumerate(samples)]
    per_token = [gather_per_sample(mb, per_sample) for mb in mbs]
    back = unpack_per_sample(mbs, per_token)
    assert len(back) == 5 and all(torch.equal(x, y) for x, y in zip(back, per_sample))
    attach_per_sample(mbs, "ref_logprobs", per_sample)
    for mb, t in zip(mbs, per_token):
        assert torch.equal(mb.ref_logprobs, t)
    keep = [k for k, mb in enumerate(mbs) if 3 not in mb.sample_ids.tolist()]
    missing = sorted({3} | {i for k, mb in enumerate(mbs) if k not in keep for i in mb.sample_ids.tolist() if i >= 0})
    with pytest.raises(ValueError, match=re.escape(f"samples {missing} missing")):
        unpack_per_sample([mbs[k] for k in keep], [per_token[k] for k in keep], num_samples=5)
    with pytest.raises(ValueError, match=r"sample \d+ appears in more than one micro-batch"):
        unpack_per_sample(mbs + mbs, per_token + per_token)
    with pytest.raises(ValueError, match="per-sample tensor 0 has 4 values, expected 5"):
        attach_per_sample(mbs, "old_logprobs", [torch.zeros(4)] + per_sample[1:])
    with pytest.raises(ValueError, match="name='advantages'"):
        attach_per_sample(mbs, "advantages", per_sample)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 16), min_size=1, max_size=24),
    prompts=st.lists(st.integers(0, 4), min_size=24, max_size=24),
    dp_size=st.integers(1, 4),
    pad_multiple=st.sampled_from([1, 2, 4, 8]),
    extra=st.integers(0, 3),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]),
)
def test_packing_invariants(lengths, prompts, dp_size, pad_multiple, extra, loss_agg):
    budget = (16 // pad_multiple + extra) * pad_multiple  # >= 16 >= every length, multiple of pad_multiple
    samples = [make_sample(n, n_prompt=p, seed=i) for i, (n, p) in enumerate(zip(lengths, prompts))]
    packed, metrics = pack_step(
        samples, dp_size=dp_size, token_budget=budget, loss_agg=loss_agg, pad_multiple=pad_multiple
    )

    # every DP rank has the same number of micro-batches
    assert len(packed) == dp_size
    assert len({len(r) for r in packed}) == 1 and metrics["pack/micro_batches_per_rank"] == len(packed[0])
    seen_tokens = {}
    for mb in flat(packed):
        s = mb.num_tokens
        # budget respected, padded to the multiple, every [S] field aligned
        assert s <= budget and s % pad_multiple == 0 and s >= 1
        for t in (mb.position_ids, mb.sample_ids, mb.loss_mask, mb.loss_weight, mb.advantages, mb.rollout_logprobs):
            assert t.shape == (s,)
        cu = mb.cu_seqlens.tolist()
        assert (mb.sample_ids[cu[-1]:] == -1).all() and (mb.loss_weight[cu[-1]:] == 0).all()
        for k in range(len(cu) - 1):
            a, b = cu[k], cu[k + 1]
            sid = int(mb.sample_ids[a])
            assert (mb.sample_ids[a:b] == sid).all()
            assert mb.position_ids[a:b].tolist() == list(range(b - a))
            assert mb.tokens[a:b].tolist() == samples[sid].tokens
            for pos in range(b - a):
                key = (sid, pos)
                assert key not in seen_tokens  # every token appears exactly once
                seen_tokens[key] = float(mb.loss_mask[a + pos])
        # loss weights only where loss_mask is 1
        assert ((mb.loss_weight != 0) <= (mb.loss_mask > 0)).all()
    expected = {(i, p): float(m) for i, smp in enumerate(samples) for p, m in enumerate(smp.loss_mask)}
    assert seen_tokens == expected
    total_w = sum(float(mb.loss_weight.sum()) for mb in flat(packed))
    n_loss = sum(s.num_loss_tokens for s in samples)
    if loss_agg in ("token-mean", "seq-mean-token-mean") and n_loss:
        assert total_w == pytest.approx(1.0, abs=1e-5)
    real = sum(lengths)
    total = sum(mb.num_tokens for mb in flat(packed))
    assert metrics["pack/padding_frac"] == pytest.approx((total - real) / total)
    assert metrics["pack/num_tokens"] == real
