"""A stand-in for an mlrl vLLM server, for the pool's unit tests (routing, failover, pause/resume).

It speaks the subset of vLLM's HTTP API the pool uses, with vLLM's semantics: per-job bearer
token on every route; /inference/v1/generate with token-level pacing (FAKE_TOKEN_DELAY_S per
token), finish_reason "abort" plus the partial output when aborted, and `weight_versions` spans
labelled with the version current when each token was produced; /pause (abort | wait) holds new
requests until /resume. Token i+1 = (token i + 1) % VOCAB, logprob of output position k is
-(k+1)/100, so a continuation of an interrupted request is checkable; `n` samples per request are
n copies. /stats reports the peak
number of concurrent requests and what the engine served.

Run: python fake_engine.py --host 127.0.0.1 --port N   (token from $MLRL_ENGINE_TOKEN)
"""

import argparse
import asyncio
import os

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

VOCAB = 50
MAX_LEN = 64
TOKEN = os.environ["MLRL_ENGINE_TOKEN"]
DELAY = float(os.environ.get("FAKE_TOKEN_DELAY_S", "0.01"))

state = {"version": "default", "paused": False, "running": {}, "peak": 0, "served": [], "resume": None, "pauses": 0,
         "seeds": []}


def _auth(request: Request) -> bool:
    return request.headers.get("authorization") == f"Bearer {TOKEN}"


def guarded(fn):
    async def wrapper(request: Request):
        if not _auth(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await fn(request)
    return wrapper


async def _wait_unpaused():
    while state["paused"]:
        await asyncio.sleep(0.005)


@guarded
async def generate(request: Request):
    body = await request.json()
    ids = body["token_ids"]
    sp = body["sampling_params"]
    if len(ids) >= MAX_LEN:
        return JSONResponse(
            {
                "error": {
                    "message": f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                    f"of {MAX_LEN}."
                }
            },
            status_code=400,
        )
    if not 0 < sp.get("top_p", 1.0) <= 1:
        return JSONResponse({"error": {"message": f"top_p must be in (0, 1], got {sp['top_p']}."}}, status_code=400)
    rid = body["request_id"]
    state["seeds"].append(sp.get("seed"))  # each request's sampling seed, in arrival order
    await _wait_unpaused()
    flag = {"abort": False}
    state["running"][rid] = flag
    state["peak"] = max(state["peak"], len(state["running"]))
    tokens, versions = [], []
    finish = "length"
    try:
        last = ids[-1]
        n = min(sp["max_tokens"], MAX_LEN - len(ids))
        for _ in range(n):
            await asyncio.sleep(DELAY)
            if flag["abort"]:
                finish = "abort"
                break
            last = (last + 1) % VOCAB
            tokens.append(last)
            versions.append(state["version"])
    finally:
        state["running"].pop(rid, None)
    state["served"].append(rid)
    spans = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    start = len(ids)
    content = [{"token": str(t), "logprob": -(start + k + 1) / 100} for k, t in enumerate(tokens)]
    # vLLM's `n`: n samples of the prompt in one answer (here all alike: the output is a function
    # of the prompt), listed last-first to check that the client orders them by `index`
    choice = {"finish_reason": finish, "token_ids": tokens, "text": " ".join(map(str, tokens)),
              "weight_versions": spans, "logprobs": {"content": content}}
    return JSONResponse({"choices": [dict(choice, index=i) for i in reversed(range(sp.get("n", 1)))]})


@guarded
async def health(request: Request):
    return JSONResponse({})


@guarded
async def pause(request: Request):
    state["paused"] = True
    state["pauses"] += 1
    if request.query_params.get("mode", "abort") == "abort":
        for f in state["running"].values():
            f["abort"] = True
    else:
        while state["running"]:
            await asyncio.sleep(0.005)
    return JSONResponse({"status": "paused"})


@guarded
async def resume(request: Request):
    state["paused"] = False
    return JSONResponse({"status": "resumed"})


@guarded
async def abort_requests(request: Request):
    ids = (await request.json()).get("request_ids") or list(state["running"])
    for rid in ids:
        if rid in state["running"]:
            state["running"][rid]["abort"] = True
    return JSONResponse({"status": "aborted", "aborted": len(ids)})


@guarded
async def update_weight_version(request: Request):
    state["version"] = (await request.json())["new_version"]
    return JSONResponse({"success": True})


@guarded
async def reset_prefix_cache(request: Request):
    return JSONResponse({"success": not state["running"]})


@guarded
async def tokenize(request: Request):
    msgs = (await request.json())["messages"]
    return JSONResponse({"tokens": [1] + [len(m["content"]) % VOCAB for m in msgs]})


@guarded
async def stats(request: Request):
    return JSONResponse(
        {"peak": state["peak"], "served": state["served"], "version": state["version"], "paused": state["paused"],
         "pauses": state["pauses"], "seeds": state["seeds"]}
    )


app = Starlette(
    routes=[
        Route("/inference/v1/generate", generate, methods=["POST"]),
        Route("/health", health),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/abort_requests", abort_requests, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/stats", stats),
    ]
)

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
