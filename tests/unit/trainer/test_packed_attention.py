"""PackedDotProductAttention (the CPU core attention of packed THD micro-batches): its contiguous-run
path equals its gather-by-length path bit for bit (outputs and gradients), and both equal plain
causal attention computed one sample at a time."""

import math

import pytest
import torch

pytest.importorskip("megatron.core.transformer.dot_product_attention")

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from mlrl.trainer.rank.local_spec import PackedDotProductAttention

HEADS, GROUPS, DIM = 4, 2, 8


@pytest.fixture(autouse=True)
def megatron_state():
    """What a trainer rank has set up before attention runs: the CPU compat layer (without CUDA),
    the seeded RNG tracker DotProductAttention forks, and the global memory buffer its scores use."""
    from megatron.core import parallel_state, tensor_parallel

    from mlrl.trainer.rank import cpu_compat

    if cpu_compat.needed():
        cpu_compat.apply()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    seeded = "model-parallel-rng" in tracker.get_states()
    if not seeded:
        tracker.add("model-parallel-rng", 0)
    fresh = parallel_state._GLOBAL_MEMORY_BUFFER is None
    if fresh:
        parallel_state._set_global_memory_buffer()
    yield
    if fresh:
        parallel_state.destroy_global_memory_buffer()
    if not seeded:
        tracker.reset()


class _Group:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _attention() -> PackedDotProductAttention:
    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, attention_dropout=0.0, use_cpu_initialization=True)
    return PackedDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self", pg_collection=ProcessGroupCollection(tp=_Group()))


def _inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, HEADS, DIM, generator=g, requires_grad=True)
    k = torch.randn(t, GROUPS, DIM, generator=g, requires_grad=True)
    v = torch.randn(t, GROUPS, DIM, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))
    return q, k, v, psp


def _by_length(attn, q, k, v, psp):
    bounds = psp.cu_seqlens_q.tolist()
    by_len: dict[int, list[int]] = {}
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            by_len.setdefault(hi - lo, []).append(lo)
    return attn._forward_by_length(q, k, v, by_len, AttnMaskType.causal, None)


def _reference(q, k, v, lengths):
    """Causal softmax attention of each sample alone (grouped-query: each kv head serves HEADS/GROUPS)."""
    outs, lo = [], 0
    for n in lengths:
        qs, ks, vs = q[lo:lo + n], k[lo:lo + n], v[lo:lo + n]
        ks, vs = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(DIM)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(n, 1, HEADS * DIM))
        lo += n
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [[8] * 6, [9, 9, 7, 7, 7, 3, 1], [12, 5, 5, 2, 2, 2, 2, 1]])
def test_runs_equal_gather_by_length_and_per_sample_attention(lengths):
    attn = _attention()
    q, k, v, psp = _inputs(lengths)
    runs = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    g_runs = torch.autograd.grad(runs.square().sum(), (q, k, v))
    gathered = _by_length(attn, q, k, v, psp)
    g_gathered = torch.autograd.grad(gathered.square().sum(), (q, k, v))
    assert torch.equal(runs, gathered)
    assert all(torch.equal(a, b) for a, b in zip(g_runs, g_gathered))
    torch.testing.assert_close(runs, _reference(q, k, v, lengths), rtol=1e-5, atol=1e-6)


def test_interleaved_lengths_take_the_gather_path_and_still_attend_per_sample():
    lengths = [3, 5, 3, 5, 2]  # a length in two runs: no contiguous block per length
    attn = _attention()
    q, k, v, psp = _inputs(lengths, seed=1)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    assert torch.equal(out, _by_length(attn, q, k, v, psp))
    torch.testing.assert_close(out, _reference(q, k, v, lengths), rtol=1e-5, atol=1e-6)


def _attention_with(**overrides) -> PackedDotProductAttention:
    kw = dict(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
              attention_dropout=0.0, use_cpu_initialization=True)
    cfg = TransformerConfig(**{**kw, **overrides})
    return PackedDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self", pg_collection=ProcessGroupCollection(tp=_Group()))


@pytest.mark.parametrize("groups", [GROUPS, HEADS])  # grouped-query and plain multi-head attention
def test_fused_kernel_runs_and_matches_megatron_math(groups, monkeypatch):
    """Plain fp32 causal attention goes through torch's fused kernel; Megatron's own math (the
    path every other layer keeps, here also for multi-head attention on strided runs) gives the
    same outputs and gradients to float32 rounding."""
    attn = _attention_with(num_query_groups=groups)
    assert attn.fused
    lengths = [9, 9, 7, 7, 7, 3, 1]
    q, k, v, psp = _inputs(lengths, seed=2)
    if groups != GROUPS:
        k, v = (x.detach().repeat_interleave(HEADS // GROUPS, dim=1).requires_grad_() for x in (k, v))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))

    def run():
        out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v))

    fused, g_fused = run()
    assert len(calls) == len(set(lengths))  # one kernel call per distinct length
    attn.fused = False
    megatron, g_megatron = run()
    assert len(calls) == len(set(lengths))  # Megatron's math does not call it
    torch.testing.assert_close(fused, megatron, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_fused, g_megatron):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"attention_dropout": 0.1}, {"window_size": (4, 0)},
                                       {"softmax_type": "learnable"}])
def test_layers_the_kernel_does_not_reproduce_keep_megatron_math(overrides):
    assert not _attention_with(**overrides).fused


def test_non_fp32_inputs_keep_megatron_math(monkeypatch):
    attn = _attention()
    assert attn.fused
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: pytest.fail("the fused kernel ran on float64 inputs"))
    q, k, v, psp = _inputs([4, 4, 2])
    out = attn(q.double(), k.double(), v.double(), None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    assert out.dtype == torch.float64


def test_shared_prefix_rows_attend_to_their_prompt_like_whole_samples():
    """A row [prompt A | a1 | a2 | lone | prompt B | b1 | b2 | b3] (responses continuing their
    group's prompt) gives each response the outputs and the gradients of the whole sample
    prompt + response attended alone, the prompt's gradient summed over its responses."""
    attn = _attention()
    g = torch.Generator().manual_seed(3)
    prompts = {"A": 5, "B": 3}
    samples = [("A", 2), ("A", 4), (None, 6), ("B", 1), ("B", 3), ("B", 3)]
    segs, prefix = [], []  # (length, prompt segment index)
    heads = {}
    for p, n in samples:
        if p is not None and p not in heads:
            heads[p] = len(segs)
            segs.append(prompts[p])
            prefix.append(-1)
        segs.append(n)
        prefix.append(heads.get(p, -1) if p is not None else -1)
    t = sum(segs)
    q = torch.randn(t, HEADS, DIM, generator=g, requires_grad=True)
    k = torch.randn(t, GROUPS, DIM, generator=g, requires_grad=True)
    v = torch.randn(t, GROUPS, DIM, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    psp.mlrl_prefix_segment = prefix
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))

    # reference: every sample whole (its prompt's rows copied in front), attended on its own
    bounds = cu.tolist()
    rows, owned = [], []  # packed row of each reference token; whether the output belongs to the sample
    for s, h in enumerate(prefix):
        if h >= 0:
            rows += list(range(bounds[h], bounds[h + 1]))
            owned += [False] * (bounds[h + 1] - bounds[h])
        if h >= 0 or s not in prefix:  # prompts are attended only through their samples
            rows += list(range(bounds[s], bounds[s + 1]))
            owned += [True] * (bounds[s + 1] - bounds[s])
    idx = torch.tensor(rows)
    lengths = [bounds[h + 1] - bounds[h] + bounds[s + 1] - bounds[s] if h >= 0 else bounds[s + 1] - bounds[s]
               for s, h in enumerate(prefix) if h >= 0 or s not in prefix]
    ref_all = _reference(q[idx], k[idx], v[idx], lengths)
    mine = torch.tensor(owned)
    ref = torch.zeros_like(out).index_copy(0, idx[mine], ref_all[mine])
    prompt_rows = torch.tensor([r for h in set(prefix) if h >= 0 for r in range(bounds[h], bounds[h + 1])])
    ref_prompt = _reference(q[prompt_rows], k[prompt_rows], v[prompt_rows],
                            [bounds[h + 1] - bounds[h] for h in sorted(set(prefix)) if h >= 0])
    ref = ref.index_copy(0, prompt_rows, ref_prompt)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"attention_dropout": 0.1}, {"softmax_type": "learnable"}])
def test_shared_prefix_rows_on_a_layer_the_kernel_does_not_reproduce_are_rejected(overrides):
    attn = _attention_with(**overrides)
    q, k, v, psp = _inputs([3, 2, 2])
    psp.mlrl_prefix_segment = [-1, 0, 0]
    with pytest.raises(ValueError, match="trainer.shared_prefix_packing"):
        attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)


def test_shared_prefix_rows_in_bfloat16_match_float32():
    """bf16 training on CPU packs shared prefixes too: the same kernel, in bf16."""
    attn = _attention()
    q, k, v, psp = _inputs([4, 2, 3, 5])
    psp.mlrl_prefix_segment = [-1, 0, 0, -1]
    ref = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, attn_mask_type=AttnMaskType.causal,
               packed_seq_params=psp)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
