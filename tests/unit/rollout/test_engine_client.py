"""EngineClient: request body, parsing of vLLM's /inference/v1/generate answer (token ids, logprobs,
weight-version spans), prompt logprobs, and the mapping of failures to typed errors."""

import json

import httpx
import pytest

from mlrl.rollout.client import (
    EngineAuthError,
    EngineClient,
    EngineRequestError,
    EngineUnavailableError,
    _versions,
    sampling_params,
)
from mlrl.types import GenerationHyperparameters, ModelRequest, StopReason


def _client(handler) -> EngineClient:
    return EngineClient("http://engine", "tok", transport=httpx.MockTransport(handler), name="e0")


async def test_generate_parses_tokens_logprobs_and_versions():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json={"choices": [{
            "finish_reason": "length", "token_ids": [5, 6, 7], "text": " a b c", "stop_reason": None,
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}, {"logprob": -2.0}]}}]})

    c = _client(handler)
    g = GenerationHyperparameters(max_new_tokens=9, temperature=0.7, top_k=5, stop_token_ids=[2], stop=["."])
    seg = await c.generate([1, 2], g, request_id="r-0", default_version=0, max_tokens=3, min_tokens=1)
    assert (seg.tokens, seg.logprobs, seg.versions, seg.finish, seg.text) == (
        [5, 6, 7],
        [-0.5, -1.0, -2.0],
        [3, 3, 4],
        "length",
        " a b c",
    )
    assert seen["auth"] == "Bearer tok"
    body = seen["body"]
    assert body["token_ids"] == [1, 2] and body["request_id"] == "r-0"
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["min_tokens"], sp["temperature"], sp["top_k"], sp["logprobs"]) == (3, 1, 0.7, 5, 0)
    assert sp["stop_token_ids"] == [2] and sp["stop"] == ["."]
    await c.aclose()


async def test_single_engine_agenerate():
    def handler(request):
        body = json.loads(request.content)
        if len(body["token_ids"]) > 3:
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "finish_reason": "stop",
                        "token_ids": [9, 2],
                        "text": "x",
                        "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                    }
                ]
            },
        )

    c = _client(handler)
    ok = await c.agenerate(ModelRequest(input_ids=[1, 2]), default_version=4)
    assert (ok.output_tokens, ok.output_versions, ok.stop_reason, ok.engine) == ([9, 2], [4, 4], StopReason.STOP, "e0")
    bad = await c.agenerate(ModelRequest(input_ids=[1, 2, 3, 4]))
    assert bad.stop_reason == StopReason.ERROR and "prompt too long" in bad.error


def test_sampling_params_greedy_and_version_spans():
    assert sampling_params(GenerationHyperparameters(greedy=True, temperature=0.9))["temperature"] == 0.0
    assert _versions([{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 3}], 4, 1) == [
        1,
        1,
        7,
        1,
    ]


@pytest.mark.parametrize("status,exc", [(400, EngineRequestError), (422, EngineRequestError), (401, EngineAuthError),
                                        (500, EngineUnavailableError), (503, EngineUnavailableError)])
async def test_http_errors_are_typed(status, exc):
    c = _client(
        lambda r: httpx.Response(status, json={"error": {"message": "prompt is longer than the maximum model length"}})
    )
    with pytest.raises(exc, match=f"HTTP {status}"):
        await c.generate([1], GenerationHyperparameters(), request_id="r", default_version=0)


async def test_transport_errors_mean_unavailable():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    c = _client(handler)
    with pytest.raises(EngineUnavailableError, match="ConnectError"):
        await c.generate([1], GenerationHyperparameters(), request_id="r", default_version=0)
    assert not await c.health()


async def test_prompt_logprobs():
    def handler(request):
        return httpx.Response(
            200,
            json={
                "prompt_logprobs": [None, {"8": {"logprob": -1.5, "rank": 2}}, {"9": {"logprob": -0.25}}],
                "choices": [{"token_ids": [1]}],
            },
        )

    assert await _client(handler).prompt_logprobs([7, 8, 9]) == [-1.5, -0.25]
    bad = _client(lambda r: httpx.Response(200, json={"prompt_logprobs": [None, {"3": {"logprob": -1.0}}]}))
    with pytest.raises(EngineUnavailableError, match="no prompt logprob for token 8"):
        await bad.prompt_logprobs([7, 8])
