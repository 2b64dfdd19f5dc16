"""The chunked logprob / entropy function (mlrl.trainer.rank.logprobs): values and gradients equal
the plain log-softmax formula at any chunking, temperature and vocabulary padding; fp64
gradcheck of the hand-written backward; no full-vocabulary fp32 tensor is saved for backward."""

import pytest
import torch

from mlrl.trainer.rank import logprobs as lpmod


def _reference(logits, labels, t, vocab):
    z = logits[:, :vocab].double() / t
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _call(logits, labels, t, vocab):
    return lpmod.vocab_parallel_logprobs(logits, labels, temperature=t, vocab_size=vocab, tp_rank=0, tp_size=1)


@pytest.mark.parametrize("t", [1.0, 0.7, 0.0])  # 0 = greedy: the model's own distribution (T = 1)
@pytest.mark.parametrize("chunk", [1 << 25, 50, 7])  # one chunk; several; a ragged last chunk
def test_values_and_grads_match_the_plain_formula(monkeypatch, t, chunk):
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    S, V, vocab = 13, 24, 21  # 3 columns of Megatron vocabulary padding
    logits = (3 * torch.randn(S, V, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (S,), generator=g)
    w_lp, w_ent = torch.randn(S, generator=g), torch.randn(S, generator=g)
    lp, ent = _call(logits, labels, t, vocab)
    (w_lp * lp + w_ent * ent).sum().backward()
    got_grad = logits.grad.clone()

    ref = logits.detach().double().requires_grad_()
    rlp, rent = _reference(ref, labels, t if t > 0 else 1.0, vocab)
    (w_lp.double() * rlp + w_ent.double() * rent).sum().backward()
    assert torch.allclose(lp.double(), rlp, atol=2e-6) and torch.allclose(ent.double(), rent, atol=2e-6)
    assert torch.allclose(got_grad.double(), ref.grad, atol=1e-6)
    assert torch.all(got_grad[:, vocab:] == 0)  # padding columns get no gradient


def test_fp64_gradcheck_of_the_backward():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, dtype=torch.float64, generator=g).requires_grad_()
    labels = torch.randint(0, 8, (5,), generator=g)
    assert torch.autograd.gradcheck(lambda x: _call(x, labels, 0.8, 8), (logits,))


def test_only_one_of_the_two_outputs_used():
    logits = torch.randn(4, 6, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 3])
    lp, _ = _call(logits, labels, 1.0, 6)
    lp.sum().backward()  # entropy's gradient arrives as None
    want = torch.nn.functional.one_hot(labels, 6) - torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, want, atol=1e-6)


def test_forward_is_bitwise_what_the_unchunked_formula_gives(monkeypatch):
    """Chunking splits rows, never a row's reduction: the values are identical bit for bit."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(33, 40, generator=g)
    labels = torch.randint(0, 40, (33,), generator=g)
    whole = _call(logits, labels, 0.9, 40)
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", 80)  # 2 rows per chunk
    chunked = _call(logits, labels, 0.9, 40)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_backward_keeps_only_the_logits_and_per_row_statistics():
    saved = []

    def pack(x):
        saved.append(x)
        return x

    logits = torch.randn(64, 500, requires_grad=True)
    labels = torch.randint(0, 500, (64,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, ent = _call(logits * 1.0, labels, 0.7, 500)
    big = [x for x in saved if x.numel() >= 64 * 500]
    assert len(big) == 1 and big[0].dtype == logits.dtype  # the logits themselves, no fp32 copy of them
    assert sum(x.numel() for x in saved) <= 64 * 500 + 4 * 64
