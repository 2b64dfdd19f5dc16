"""Workflow results -> Samples (every accepted shape), and the small API helpers."""

import pytest
import torch

from mlrl.types import ModelResponse, Sample, SampleStatus, StopReason
from mlrl.workflow import ModelRequest, WorkflowResultError, apply_chat_template, sample_from_response, to_samples
from mlrl.workflow.agent_proxy.interactions import Interaction


def resp(p=(5, 6, 7), o=(8, 9), lps=(-0.5, -0.25), vers=(3, 4), stop=StopReason.STOP):
    return ModelResponse(
        input_tokens=list(p),
        output_tokens=list(o),
        output_logprobs=list(lps),
        output_versions=list(vers),
        stop_reason=stop,
    )


def test_areal_tensor_dict_with_batch_dim():
    seq = [5, 6, 7, 8, 9]
    d = {
        "input_ids": torch.tensor([seq], dtype=torch.int32),
        "loss_mask": torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, 0.0, 0.0, -0.5, -0.25]]),
        "versions": torch.tensor([[-1, -1, -1, 3, 4]], dtype=torch.int32),
        "attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "rewards": torch.tensor([1.0]),
    }
    (s,) = to_samples(d)
    assert s.tokens == seq and s.loss_mask == [0, 0, 0, 1, 1] and s.prompt_len == 3
    assert s.rollout_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25] and s.versions == [-1, -1, -1, 3, 4] and s.reward == 1.0


def test_batched_padded_dict_drops_padding_and_splits_rows():
    d = {
        "input_ids": [[1, 2, 3, 0], [1, 2, 3, 4]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]],
        "loss_mask": [[0, 1, 1, 0], [0, 0, 1, 1]],
        "logprobs": [[0, -1, -2, 0], [0, 0, -3, -4]],
        "versions": [[-1, 0, 0, 0], [-1, -1, 1, 1]],
        "rewards": [0.5, 1.5],
    }
    a, b = to_samples(d)
    assert a.tokens == [1, 2, 3] and a.loss_mask == [0, 1, 1] and a.reward == 0.5 and a.prompt_len == 1
    assert b.tokens == [1, 2, 3, 4] and b.rollout_logprobs == [0.0, 0.0, -3.0, -4.0] and b.prompt_len == 2


def test_unbatched_lists_and_missing_optional_fields_are_flagged():
    (s,) = to_samples({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "rewards": 2.0})
    assert s.versions == [-1, -1, -1] and s.rollout_logprobs == [0.0] * 3
    assert s.metadata == {"missing_logprobs": True, "missing_versions": True}


def test_lists_none_samples_and_interactions():
    s0 = sample_from_response(resp(), 1.0)
    inter = Interaction(id="c1", model_response=resp(o=(10,), lps=(-1.0,), vers=(2,)), reward=0.25)
    out = to_samples([None, s0, [{"input_ids": [1, 2], "loss_mask": [0, 1], "rewards": 0.0}], {"c1": inter}])
    assert [len(s.tokens) for s in out] == [5, 2, 4]
    assert out[2].reward == 0.25 and out[2].metadata["interaction_id"] == "c1" and out[2].versions == [-1, -1, -1, 2]
    assert to_samples(None) == []


@pytest.mark.parametrize(
    "bad,msg",
    [
        ({"loss_mask": [1], "rewards": 1.0}, "no 'input_ids'"),
        ({"input_ids": [1, 2], "rewards": 1.0}, "no 'loss_mask'"),
        ({"input_ids": [1, 2], "loss_mask": [0, 1]}, "no 'rewards'"),
        ({"input_ids": [1, 2], "loss_mask": [0, 1, 1], "rewards": 1.0}, "loss_mask has length 3"),
        ({"input_ids": [[1], [2]], "loss_mask": [[1], [1]], "rewards": [1.0]}, "2 sequences but 1 rewards"),
        ("text", "workflow returned str"),
    ],
)
def test_malformed_results_are_named(bad, msg):
    with pytest.raises(WorkflowResultError, match=msg):
        to_samples(bad)


def test_sample_from_response_and_truncation():
    s = sample_from_response(resp(stop=StopReason.LENGTH), 0.5, note="x")
    assert s.tokens == [5, 6, 7, 8, 9] and s.loss_mask == [0, 0, 0, 1, 1] and s.versions == [-1, -1, -1, 3, 4]
    assert s.status == SampleStatus.TRUNCATED and s.metadata == {"note": "x"} and isinstance(s, Sample)
    with pytest.raises(ValueError, match="2 output tokens but 1 logprobs"):
        sample_from_response(resp(lps=(-1.0,)), 0.0)


def test_model_request_accepts_areal_tokenizer_field(tok):
    r = ModelRequest(input_ids=[1, 2], tokenizer=tok)
    assert r.tokenizer is tok and r.input_ids == [1, 2]


def test_apply_chat_template_returns_token_ids(tok):
    ids = apply_chat_template(tok, [{"role": "user", "content": "copy 7"}], add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "user : copy 7 . assistant :"
    assert apply_chat_template(tok, [{"role": "user", "content": "copy 7"}], tokenize=False) == "user : copy 7 . "
