"""FP8 padding of packed micro-batches (trainer.fp8_recipe, a GPU path checked here on CPU):
the row handed to Megatron grows to what TE's FP8 GEMMs need, the padding is its own THD segment
with no labels, and the token-aligned outputs are cut back to the micro-batch's own length, so
the padding never reaches the loss or the logprobs."""

import pytest
import torch

from mlrl.experience.batch import MicroBatch
from mlrl.trainer.rank.inputs import FP8_TOKEN_MULTIPLE, build_inputs, cp_padded_lengths, row_multiple
from mlrl.trainer.rank.logprobs import align_to_tokens


def _mb(lengths, tail=0):
    n = sum(lengths) + tail
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(3, 50, (n,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(k) for k in lengths] + [torch.zeros(tail, dtype=torch.int64)])
    z = torch.zeros(n)
    return MicroBatch(tokens=tokens, position_ids=pos, cu_seqlens=cu, sample_ids=torch.zeros(n, dtype=torch.int64),
                      loss_mask=z, loss_weight=z, advantages=z, rollout_logprobs=z)


@pytest.mark.parametrize("recipe,lengths,tail,want", [
    ("tensorwise", [6, 9], 0, 16),      # 15 tokens: the length that crashed TE on an H100
    ("delayed", [6, 9], 0, 16),
    ("tensorwise", [16], 0, 16),         # already a multiple: untouched
    ("tensorwise", [7, 9], 3, 32),       # a padding tail of its own is extended, not duplicated
    ("blockwise", [100, 9], 0, 128),
    ("none", [6, 9], 0, 15),             # bf16: no padding at all
])
def test_row_is_padded_to_the_fp8_multiple(recipe, lengths, tail, want):
    mb = _mb(lengths, tail)
    inp = build_inputs(mb, torch.device("cpu"), fp8_recipe=recipe)
    S = sum(lengths) + tail
    assert inp.tokens.shape == (1, want) and inp.length == S
    cu = inp.packed_seq_params.cu_seqlens_q.tolist()
    assert cu[: len(lengths) + 1] == [0, *torch.tensor(lengths).cumsum(0).tolist()]  # the samples keep their segments
    assert cu[-1] == want and len(cu) == len(lengths) + 1 + (1 if want > sum(lengths) else 0)  # one padding segment
    assert not inp.label_mask[sum(lengths):].any()   # padding predicts nothing
    assert inp.label_mask[: sum(lengths)].sum() == sum(k - 1 for k in lengths)


def test_padding_never_reaches_the_token_values():
    """Per-position values of the padded row -> token-aligned values of the micro-batch: equal to
    those of the unpadded row, whatever the padding positions hold."""
    mb = _mb([6, 9])
    plain = build_inputs(mb, torch.device("cpu"))
    fp8 = build_inputs(mb, torch.device("cpu"), fp8_recipe="tensorwise")
    values = torch.randn(16)
    got = align_to_tokens(values, fp8.label_mask)[: fp8.length]
    want = align_to_tokens(values[:15], plain.label_mask)[: plain.length]
    assert torch.equal(got, want)
    values[15] = 1e9  # garbage in the padding slot changes nothing
    assert torch.equal(align_to_tokens(values, fp8.label_mask)[: fp8.length], want)


def test_sequence_parallel_pads_each_tp_slice_to_the_fp8_multiple():
    assert row_multiple(fp8_recipe="tensorwise", tp=2, sequence_parallel=True) == 32
    assert row_multiple(fp8_recipe="tensorwise", tp=2, sequence_parallel=False) == 16
    assert row_multiple(tp=4, sequence_parallel=True) == 4  # bf16 + SP: the row splits evenly over TP
    inp = build_inputs(_mb([6, 9]), torch.device("cpu"), tp=2, sequence_parallel=True, fp8_recipe="tensorwise")
    assert inp.tokens.shape[1] == 32


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("multiple", [1, FP8_TOKEN_MULTIPLE["tensorwise"], FP8_TOKEN_MULTIPLE["blockwise"]])
def test_context_parallel_segments_and_rank_slices(cp, multiple):
    lens = [5, 1, 12, 3]
    padded = cp_padded_lengths(lens, cp, multiple)
    assert all(p >= n and p % (2 * cp) == 0 for p, n in zip(padded, lens))  # TE's THD split: 2*cp chunks each
    assert sum(padded) % (cp * multiple) == 0                              # each CP rank's slice: the FP8 multiple
    assert padded[:-1] == [(n + 2 * cp - 1) // (2 * cp) * (2 * cp) for n in lens[:-1]]  # only the last grows
    assert sum(padded) - sum(lens) < cp * max(multiple, 2) + len(lens) * 2 * cp  # no more than needed


@pytest.mark.parametrize("tp,fp8", [(4, "none"), (2, "tensorwise"), (3, "none")])
def test_context_parallel_slices_divide_over_tp_under_sequence_parallelism(monkeypatch, tp, fp8):
    """cp > 1 with sequence parallelism: each CP rank's slice is split again over the TP ranks, so it
    must divide by tp (times FP8's multiple). Before, only FP8's multiple was asked for: [10] at
    cp=2 gave 6-token slices, which Megatron's scatter to 4 TP ranks refuses. (_cp_inputs itself
    needs Transformer Engine: what build_inputs asks of it is checked here.)"""
    from mlrl.trainer.rank import inputs as inputs_mod

    asked = []
    monkeypatch.setattr(inputs_mod, "_cp_inputs", lambda *a: asked.append(a[-1]))
    build_inputs(_mb([10]), torch.device("cpu"), tp=tp, sequence_parallel=True, cp=2, fp8_recipe=fp8)
    (multiple,) = asked
    assert multiple == FP8_TOKEN_MULTIPLE[fp8] * tp
    for lens in ([10], [100, 3, 1], [7, 7, 7]):
        padded = cp_padded_lengths(lens, 2, multiple)
        assert (sum(padded) // 2) % multiple == 0 and all(p % 4 == 0 for p in padded)
