"""SFT loss parity: the Megatron policy's SFT loss on a batch of real SFT conversations equals Hugging
Face's causal-LM loss on the same batch within 1e-5 (fp32) at TP1 (DP2), TP2 and TP2 + sequence
parallelism; two gloo ranks, one torchrun launch (sft_parity_worker.py)."""

from pathlib import Path

import pytest
from trainer_harness import run_torchrun

WORKER = Path(__file__).with_name("sft_parity_worker.py")
LAYOUTS = ["ref", "tp2", "tp2+sp"]  # ref = tp1 / dp2
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks():
    results, _ = run_torchrun(WORKER, ["--layouts", ",".join(LAYOUTS)], 2, timeout=300)
    return results


def test_the_mask_covers_exactly_the_assistant_turns(ranks):
    r = ranks[0]
    # the template renders "{role} : {content} . ": each assistant turn trains on its content and the " ."
    assert r["mask_spans"] == [c + " ." for c in r["multi_turn_contents"]]
    assert len(r["mask_spans"]) == 2
    # the batch mixes lengths (long arith_word prompts, short copy / add rows, the multi-turn one)
    assert min(r["lengths"]) < 12 and max(r["lengths"]) > 25 and len(r["lengths"]) == 13


def test_hf_reference_is_consistent(ranks):
    hf = ranks[0]["hf"]
    # HF's per-conversation means recombined by token counts == one log_softmax sum over the batch
    assert abs(hf["batch_loss"] - hf["batch_loss_logsoftmax"]) <= 1e-6, hf
    assert hf["counts"][-1] == sum(len(s.split()) for s in ranks[0]["mask_spans"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_loss_matches_hf(ranks, layout):
    hf = ranks[0]["hf"]
    for r in ranks:
        got = r[layout]["batch"]
        assert got["micro_batches"] >= 2, got  # the step is split: the token-mean weights span micro-batches
        assert got["loss_tokens"] == got["pack_loss_tokens"] == hf["loss_tokens"]
        assert abs(got["loss"] - hf["batch_loss"]) <= TOL, (layout, got["loss"], hf["batch_loss"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_conversation_loss_is_hf_loss(ranks, layout):
    """The label-shift convention: for one conversation, Megatron's SFT loss == HF's own `.loss`
    with labels = input_ids on the masked tokens, -100 elsewhere."""
    hf = ranks[0]["hf"]
    for r in ranks:
        got = r[layout]["single"]
        assert got["loss_tokens"] == hf["counts"][-1]
        assert abs(got["loss"] - hf["losses"][-1]) <= TOL, (layout, got["loss"], hf["losses"][-1])
