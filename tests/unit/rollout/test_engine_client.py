"""EngineClient: request body, parsing of vLLM's /inference/v1/generate answer (token ids, logprobs,
weight-version spans), prompt logprobs, and the mapping of failures to typed errors.

The engine is a real local HTTP server (aiohttp.web) running a handler that takes the request
(as an httpx.Request, used here only as a data type) and returns an httpx.Response."""

import json
import socket

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from mlrl.rollout.client import (
    EngineAuthError,
    EngineClient,
    EngineRequestError,
    EngineUnavailableError,
    _versions,
    sampling_params,
)
from mlrl.types import GenerationHyperparameters, ModelRequest, StopReason


@pytest_asyncio.fixture
async def serve():
    """serve(handler) -> an EngineClient talking to a local HTTP server that answers with handler."""
    runners, clients = [], []

    async def start(handler) -> EngineClient:
        async def answer(request: web.Request) -> web.Response:
            req = httpx.Request(request.method, str(request.url), headers=dict(request.headers),
                                content=await request.read())
            resp = handler(req)
            return web.Response(status=resp.status_code, body=resp.content, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        clients.append(EngineClient(f"http://127.0.0.1:{port}", "tok", name="e0"))
        return clients[-1]

    yield start
    for c in clients:
        await c.aclose()
    for r in runners:
        await r.cleanup()


async def test_generate_parses_tokens_logprobs_and_versions(serve):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json={"choices": [{
            "finish_reason": "length", "token_ids": [5, 6, 7], "text": " a b c", "stop_reason": None,
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}, {"logprob": -2.0}]}}]})

    c = await serve(handler)
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
    assert body["output_mode"] == "tokens"  # no rendered text / token strings: workflows decode themselves
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["min_tokens"], sp["temperature"], sp["top_k"], sp["logprobs"]) == (3, 1, 0.7, 5, 0)
    assert sp["stop_token_ids"] == [2] and sp["stop"] == ["."]


async def test_single_engine_agenerate(serve):
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

    c = await serve(handler)
    ok = await c.agenerate(ModelRequest(input_ids=[1, 2]), default_version=4)
    assert (ok.output_tokens, ok.output_versions, ok.stop_reason, ok.engine) == ([9, 2], [4, 4], StopReason.STOP, "e0")
    bad = await c.agenerate(ModelRequest(input_ids=[1, 2, 3, 4]))
    assert bad.stop_reason == StopReason.ERROR and "prompt too long" in bad.error


async def test_generate_n_orders_samples_by_index_and_checks_the_count(serve):
    def handler(request):
        n = json.loads(request.content)["sampling_params"]["n"]
        choices = [{"index": i, "finish_reason": "stop", "token_ids": [i], "text": str(i),
                    "logprobs": {"content": [{"logprob": -float(i)}]}} for i in range(n)]
        return httpx.Response(200, json={"choices": choices[::-1]})  # out of order: the client sorts by index

    c = await serve(handler)
    segs = await c.generate_n([1], GenerationHyperparameters(), 3, request_id="g", default_version=2)
    assert [s.tokens for s in segs] == [[0], [1], [2]] and [s.logprobs for s in segs] == [[-0.0], [-1.0], [-2.0]]
    short = await serve(lambda r: httpx.Response(200, json={"choices": []}))
    with pytest.raises(EngineUnavailableError, match="asked for 2 samples, the answer has 0"):
        await short.generate_n([1], GenerationHyperparameters(), 2, request_id="g", default_version=0)


def test_sampling_params_greedy_and_version_spans():
    assert sampling_params(GenerationHyperparameters(greedy=True, temperature=0.9))["temperature"] == 0.0
    # tokens only: vLLM detokenizes only when stop strings need the text
    assert sampling_params(GenerationHyperparameters())["detokenize"] is False
    assert sampling_params(GenerationHyperparameters(stop=["\n\n"]))["detokenize"] is True
    assert _versions([{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 3}], 4, 1) == [
        1,
        1,
        7,
        1,
    ]


@pytest.mark.parametrize("status,exc", [(400, EngineRequestError), (422, EngineRequestError), (401, EngineAuthError),
                                        (500, EngineUnavailableError), (503, EngineUnavailableError)])
async def test_http_errors_are_typed(serve, status, exc):
    c = await serve(
        lambda r: httpx.Response(status, json={"error": {"message": "prompt is longer than the maximum model length"}})
    )
    with pytest.raises(exc, match=f"HTTP {status}"):
        await c.generate([1], GenerationHyperparameters(), request_id="r", default_version=0)


async def test_transport_errors_mean_unavailable():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    c = EngineClient(f"http://127.0.0.1:{port}", "tok", name="e0")
    where = r"e0 \(http://127.0.0.1:\d+/inference/v1/generate\)"
    with pytest.raises(EngineUnavailableError, match=where + r": Client\w*Error"):
        await c.generate([1], GenerationHyperparameters(), request_id="r", default_version=0)
    assert not await c.health()
    await c.aclose()


async def test_prompt_logprobs(serve):
    def handler(request):
        return httpx.Response(
            200,
            json={
                "prompt_logprobs": [None, {"8": {"logprob": -1.5, "rank": 2}}, {"9": {"logprob": -0.25}}],
                "choices": [{"token_ids": [1]}],
            },
        )

    assert await (await serve(handler)).prompt_logprobs([7, 8, 9]) == [-1.5, -0.25]
    bad = await serve(lambda r: httpx.Response(200, json={"prompt_logprobs": [None, {"3": {"logprob": -1.0}}]}))
    with pytest.raises(EngineUnavailableError, match="no prompt logprob for token 8"):
        await bad.prompt_logprobs([7, 8])


def _choice(tok: int) -> dict:
    return {"index": 0, "finish_reason": "stop", "token_ids": [tok], "logprobs": {"content": [{"logprob": -0.5}]}}


async def test_requests_of_one_loop_pass_share_one_batched_call(serve):
    """Concurrent generate calls travel in ONE POST /mlrl/generate_batch; each gets its own answer
    (in order) or its own error, as if sent alone."""
    import asyncio

    posts = []

    def handler(request):
        body = json.loads(request.content)
        posts.append((request.url.path, body))
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(200, json={"choices": [_choice(body["token_ids"][0] + 100)]})
        answers = []
        for r in body["requests"]:
            if r["token_ids"][0] == 99:
                answers.append({"status": 400, "error": {"message": "token 99 is out of vocabulary", "code": 400}})
            else:
                answers.append({"choices": [_choice(r["token_ids"][0] + 100)]})
        return httpx.Response(200, json={"responses": answers})

    c = await serve(handler)
    g = GenerationHyperparameters()
    out = await asyncio.gather(*(c.generate([t], g, request_id=f"r{t}", default_version=0) for t in (1, 99, 3)),
                               return_exceptions=True)
    assert posts[0][0] == "/mlrl/generate_batch" and len(posts) == 1
    assert [r["request_id"] for r in posts[0][1]["requests"]] == ["r1", "r99", "r3"]
    assert out[0].tokens == [101] and out[2].tokens == [103] and c.batched_requests == 3
    assert isinstance(out[1], EngineRequestError) and "out of vocabulary" in str(out[1]) and out[1].status == 400
    alone = await c.generate([5], g, request_id="r5", default_version=0)  # a lone request: the plain route
    assert alone.tokens == [105] and posts[-1][0] == "/inference/v1/generate"


async def test_a_server_without_the_batch_route_gets_single_requests(serve):
    import asyncio

    paths = []

    def handler(request):
        paths.append(request.url.path)
        if request.url.path == "/mlrl/generate_batch":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"choices": [_choice(json.loads(request.content)["token_ids"][0])]})

    c = await serve(handler)
    g = GenerationHyperparameters()
    segs = await asyncio.gather(*(c.generate([t], g, request_id=f"r{t}", default_version=0) for t in (1, 2, 3)))
    assert [s.tokens for s in segs] == [[1], [2], [3]]
    assert paths.count("/mlrl/generate_batch") == 1 and paths.count("/inference/v1/generate") == 3
    await asyncio.gather(*(c.generate([t], g, request_id=f"s{t}", default_version=0) for t in (4, 5)))
    assert paths.count("/mlrl/generate_batch") == 1  # not asked again
    assert c.batched_requests == 0


async def test_a_failed_batch_fails_each_of_its_requests(serve):
    import asyncio

    c = await serve(lambda r: httpx.Response(503, json={"error": {"message": "engine dead"}}))
    out = await asyncio.gather(*(c.generate([t], GenerationHyperparameters(), request_id=f"r{t}", default_version=0)
                                 for t in (1, 2)), return_exceptions=True)
    assert all(isinstance(e, EngineUnavailableError) and "engine dead" in str(e) for e in out)


async def test_a_batched_request_given_up_is_aborted_on_the_engine():
    """A caller that stops waiting (a timeout) for a request already sent in a batch: the engine is
    told to abort it (a lone request's closed connection does that in vLLM)."""
    import asyncio

    release, aborted = asyncio.Event(), []

    async def batch(request: web.Request) -> web.Response:
        body = await request.json()
        await release.wait()
        return web.json_response({"responses": [{"choices": [_choice(r["token_ids"][0])]} for r in body["requests"]]})

    async def abort(request: web.Request) -> web.Response:
        aborted.extend((await request.json())["request_ids"])
        release.set()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/mlrl/generate_batch", batch)
    app.router.add_post("/abort_requests", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    c = EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "tok", name="e0")
    try:
        g = GenerationHyperparameters()
        slow = asyncio.ensure_future(c.generate([1], g, request_id="gives-up", default_version=0))
        kept = asyncio.ensure_future(c.generate([2], g, request_id="waits", default_version=0))
        await asyncio.sleep(0.2)  # both sent in one batch, which the engine holds
        slow.cancel()
        assert (await kept).tokens == [2]  # the abort released the batch; the other request was answered
        assert aborted == ["gives-up"]
    finally:
        await c.aclose()
        await runner.cleanup()
