"""Router replay rows through packing and onto a trainer rank's token slice: every sample's rows
land at its own positions, positions the engine never computed are -1 and route to experts
0..k-1, and a sequence-parallel rank gets its own contiguous slice."""

import numpy as np
import pytest
import torch

from mlrl.experience.packing import pack_step
from mlrl.trainer.rank.router_replay import local_rows
from mlrl.types import Sample

L, K = 3, 2


def sample(n, seed, with_rows=True):
    rng = np.random.default_rng(seed)
    s = Sample(tokens=rng.integers(1, 50, n).tolist(), loss_mask=[0] + [1] * (n - 1), rollout_logprobs=[0.0] * n,
               versions=[0] * n)
    if with_rows:
        s.routed_experts = rng.integers(0, 8, (n - 1, L, K)).astype(np.uint8)
    return s


def test_rows_follow_their_samples_through_packing():
    samples = [sample(n, i) for i, n in enumerate((5, 3, 7, 4))]
    packed, _ = pack_step(samples, dp_size=2, token_budget=8, loss_agg="token-mean", pad_multiple=4)
    seen = set()
    for mb in (mb for rank in packed for mb in rank):
        r = mb.routed_experts
        assert r.shape == (mb.num_tokens, L, K) and r.dtype == torch.int16
        ids = mb.sample_ids.tolist()
        for i in set(ids) - {-1}:
            pos = [p for p, x in enumerate(ids) if x == i]
            want = torch.from_numpy(samples[i].routed_experts.astype(np.int16))
            assert torch.equal(r[pos[:-1]], want)           # every computed position, in order
            assert (r[pos[-1]] == -1).all()                  # the last token was never fed to the engine
            seen.add(i)
        assert (r[[p for p, x in enumerate(ids) if x == -1]] == -1).all()  # padding
    assert seen == {0, 1, 2, 3}


def test_a_step_is_replayed_whole_or_not_at_all():
    packed, _ = pack_step([sample(4, 0, False), sample(5, 1, False)], dp_size=1, token_budget=16,
                          loss_agg="token-mean")
    assert packed[0][0].routed_experts is None
    with pytest.raises(ValueError, match="some samples of the micro-batch carry routed experts"):
        pack_step([sample(4, 0), sample(5, 1, False)], dp_size=1, token_budget=16, loss_agg="token-mean")


def test_local_rows_pad_fill_and_sequence_parallel_slices():
    rows = torch.tensor([[[3, 1]] * L, [[-1, -1]] * L, [[0, 2]] * L], dtype=torch.int16)  # S = 3
    full, real = local_rows(rows, 4)  # S' = 4 (sequence-parallel padding)
    assert full.dtype == torch.int64 and full.shape == (4, L, K)
    assert full[:, 0].tolist() == [[3, 1], [0, 1], [0, 2], [0, 1]]
    assert real.tolist() == [True, False, True, False]
    parts = [local_rows(rows, 4, sp_rank=r, sp_size=2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full)
    assert torch.equal(torch.cat([p[1] for p in parts]), real)
