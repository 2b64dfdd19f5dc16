"""pack_step(shared_prefix=True): one copy of each prompt group's common prefix per unit."""

import pytest
import torch

from mlrl.experience.packing import (
    SHARED,
    attach_per_sample,
    gather_per_sample,
    pack_step,
    shared_prefix_length,
    unpack_per_sample,
)
from mlrl.types import Sample


def sample(tokens, n_prompt, group="", advantage=1.0):
    n = len(tokens)
    mask = [0] * n_prompt + [1] * (n - n_prompt)
    return Sample(tokens=list(tokens), loss_mask=mask, rollout_logprobs=[-0.5 * m for m in mask],
                  versions=[0] * n, prompt_len=n_prompt, group_id=group, advantage=advantage)


def group_of(prompt, responses, group="g", advantages=None):
    advantages = advantages or [float(i) - 1.0 for i in range(len(responses))]
    return [sample(prompt + r, len(prompt), group, a) for r, a in zip(responses, advantages)]


def test_shared_length_stops_before_the_first_policy_token_and_leaves_each_sample_a_token():
    g = group_of([5, 6, 7, 8], [[1, 2], [3], [1, 4]])
    assert shared_prefix_length(g) == 3  # the prompt but its last token (it predicts the first response token)
    # responses that start alike are not shared: the prefix stops before the first policy token
    assert shared_prefix_length(group_of([5, 6], [[1, 2], [1, 3]])) == 1
    assert shared_prefix_length([g[0]]) == 0  # one sample: nothing to share
    assert shared_prefix_length(group_of([5], [[1], [2]])) == 0  # a one-token prompt has nothing to spare
    # prompts that differ after 2 tokens share 2
    assert shared_prefix_length([sample([5, 6, 7, 8, 1], 4, "g"), sample([5, 6, 9, 9, 2], 4, "g")]) == 2
    # a policy token inside the prompt region (multi-turn) bounds it too
    multi = [Sample(tokens=[5, 6, 7, 8, 1], loss_mask=[0, 1, 0, 0, 1], rollout_logprobs=[0.0] * 5,
                    versions=[0] * 5, group_id="g"), sample([5, 6, 7, 8, 2], 4, "g")]
    assert shared_prefix_length(multi) == 0


def test_packed_row_layout():
    samples = group_of([5, 6, 7, 8], [[1, 2], [3]]) + [sample([9, 9, 9], 1)]
    (mbs,), m = pack_step(samples, dp_size=1, token_budget=64, loss_agg="token-mean", shared_prefix=True)
    (mb,) = mbs
    assert mb.tokens.tolist() == [5, 6, 7, 8, 1, 2, 8, 3, 9, 9, 9]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2]
    assert mb.sample_ids.tolist() == [SHARED] * 3 + [0, 0, 0, 1, 1, 2, 2, 2]
    assert mb.cu_seqlens.tolist() == [0, 3, 6, 8, 11]
    assert mb.prefix_segment.tolist() == [-1, 0, 0, -1]
    assert mb.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert mb.advantages.tolist() == [0, 0, 0, 0, -1, -1, 0, 0, 0, 1, 1]  # advantages -1, 0 and the lone 1.0
    assert m["pack/num_tokens"] == 11 and m["pack/shared_prefix_saved_frac"] == pytest.approx(3 / 14)
    # the loss weights are the per-sample packing's: sharing drops no policy token
    (plain,), _ = pack_step(samples, dp_size=1, token_budget=64, loss_agg="token-mean")
    assert mb.loss_weight.sum() == pytest.approx(float(plain[0].loss_weight.sum()))
    assert plain[0].prefix_segment is None and "pack/shared_prefix_saved_frac" not in _


def test_per_sample_maps_round_trip():
    samples = (group_of([5, 6, 7, 8, 4], [[1, 2], [3], [7, 7, 7]], "a") + [sample([9, 9, 9], 1)]
               + group_of([2, 2, 2], [[1], [2, 3]], "b"))
    packed, _ = pack_step(samples, dp_size=2, token_budget=12, loss_agg="token-mean", shared_prefix=True)
    flat = [mb for rank in packed for mb in rank]
    # per-sample values that agree on the shared prefix (as logprobs / values of the same tokens do)
    per = [torch.tensor([float(x) + (100.0 * i if t >= s.prompt_len - 1 else 0.0) for t, x in enumerate(s.tokens)])
           for i, s in enumerate(samples)]
    rows = [gather_per_sample(mb, per) for mb in flat]
    back = unpack_per_sample(flat, rows, len(samples))
    assert all(torch.equal(a, b) for a, b in zip(back, per))
    attach_per_sample(flat, "old_logprobs", per)
    assert all(torch.equal(mb.old_logprobs, r) for mb, r in zip(flat, rows))
    # unpacking the tokens gives back every sample's tokens
    toks = unpack_per_sample(flat, [mb.tokens for mb in flat], len(samples))
    assert [t.tolist() for t in toks] == [s.tokens for s in samples]


def test_a_group_longer_than_the_budget_is_cut_into_units_each_with_its_prefix():
    samples = group_of([5, 6, 7, 8, 9], [[1, 2, 3]] * 4)  # shared 4 + 4 x 4 own tokens = 20
    packed, _ = pack_step(samples, dp_size=1, token_budget=12, loss_agg="token-mean", shared_prefix=True)
    mbs = packed[0]
    assert all(mb.num_tokens <= 12 for mb in mbs)
    prefixes = sum(int((mb.sample_ids == SHARED).sum()) for mb in mbs)
    assert prefixes == 4 * 2  # two units of two samples, each with its own copy of the 4 shared tokens
    toks = unpack_per_sample(mbs, [mb.tokens for mb in mbs], 4)
    assert [t.tolist() for t in toks] == [s.tokens for s in samples]


def test_without_the_knob_packing_is_unchanged():
    samples = group_of([5, 6, 7, 8], [[1, 2], [3], [4, 4]])
    (a,), _ = pack_step(samples, dp_size=1, token_budget=64, loss_agg="token-mean")
    (b,), _ = pack_step(samples, dp_size=1, token_budget=64, loss_agg="token-mean", shared_prefix=False)
    assert a[0].tokens.tolist() == [t for s in samples for t in s.tokens] == b[0].tokens.tolist()
    assert a[0].prefix_segment is None
