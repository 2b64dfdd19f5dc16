"""The vectorised THD RoPE (mlrl.trainer.rank.packed_rope) equals Megatron-Core's per-sequence
loop bit for bit, for both frequency layouts megatron accepts (max-length table, per-token table),
plain and interleaved rotary, and leaves context-parallel calls to the original."""

import pytest
import torch

rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

from mlrl.trainer.rank import packed_rope  # noqa: E402


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.fixture
def original():
    packed_rope.install()
    return packed_rope._ORIGINAL


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_same_bits_as_megatron(original, interleaved, per_token):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 3, 12, 1, 5, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, h, d = sum(lengths), 4, 16
    t = torch.randn(T, h, d, generator=g)
    freqs = torch.randn(T if per_token else 16, 1, 1, d, generator=g)
    want = original(t, cu, freqs, rotary_interleaved=interleaved, mscale=1.3, cp_group=_Group(1))
    got = packed_rope.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved, mscale=1.3,
                                               cp_group=_Group(1))
    assert torch.equal(got, want)
    assert rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd  # megatron calls it


def test_context_parallel_goes_to_megatron(original, monkeypatch):
    calls = []
    monkeypatch.setattr(packed_rope, "_ORIGINAL", lambda *a, **k: calls.append(k["cp_group"].size()) or a[0])
    t = torch.zeros(4, 1, 2)
    packed_rope.apply_rotary_pos_emb_thd(t, torch.tensor([0, 4], dtype=torch.int32), torch.zeros(8, 1, 1, 2),
                                         cp_group=_Group(2))
    assert calls == [2]


def _case(seed, d=16, rot=16, table=16):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 1, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t = torch.randn(sum(lengths), 4, d, generator=g, requires_grad=True)
    return t, cu, torch.randn(table, 1, 1, rot, generator=g)


def test_tables_are_reused_within_a_forward_and_rebuilt_when_inputs_change(original):
    """q and k of every layer share one (freqs, cu_seqlens): the cos / sin tables are built once;
    a new freqs tensor, or one changed in place, gets new tables. Outputs and gradients keep
    megatron's bits throughout, a partial rotary dimension (pass-through part) included."""
    t, cu, freqs = _case(1)
    first = packed_rope.apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.7, cp_group=_Group(1))
    tables = packed_rope._TABLES["tables"]
    again = packed_rope.apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.7, cp_group=_Group(1))
    assert packed_rope._TABLES["tables"] is tables
    want = original(t, cu, freqs, mscale=0.7, cp_group=_Group(1))
    assert torch.equal(first, want) and torch.equal(again, want)
    g_got = torch.autograd.grad(again.square().sum(), t)[0]
    g_want = torch.autograd.grad(want.square().sum(), t)[0]
    assert torch.equal(g_got, g_want)

    freqs.mul_(2.0)  # in place: a stale table would rotate by the old angles
    got = packed_rope.apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.7, cp_group=_Group(1))
    assert packed_rope._TABLES["tables"] is not tables
    assert torch.equal(got, original(t, cu, freqs, mscale=0.7, cp_group=_Group(1)))

    t2, cu2, freqs2 = _case(2, d=24, rot=16)  # another forward; rotary on 16 of 24 channels
    got = packed_rope.apply_rotary_pos_emb_thd(t2, cu2, freqs2, cp_group=_Group(1))
    assert torch.equal(got, original(t2, cu2, freqs2, cp_group=_Group(1)))
    assert torch.equal(got[..., 16:], t2[..., 16:])
