"""Async HTTP client of ONE mlrl vLLM engine: generation plus the control endpoints.

Generation uses vLLM's token-in/token-out endpoint `POST /inference/v1/generate` (enabled by
`--enable-scale-out`) rather than `/v1/completions`: it takes prompt token ids, returns output
token ids with the logprob of every sampled token, and — unlike /v1/completions — the weight
version that produced each token (`weight_versions` spans recorded by the engine core, set by
`/finish_weight_update`). One call = one `Segment`; the pool stitches segments of an
interrupted request together. vLLM 0.26 has no weight versions (mlrl.rollout.vllm_compat): every
token then carries the `default_version` of the call, the pool's version when it was made, which
is the version that produced it since the pool only updates paused, drained engines.

Requests made in the same event-loop pass (the prompt groups of a step start together) travel in
ONE HTTP round trip, `POST /mlrl/generate_batch` (mlrl.rollout.batch_route, loaded into the
server), which runs each through the same vLLM handler and answers each on its own: same
results, same per-request errors, one HTTP cost. A server without that route (404) gets one
request each from then on.

Answers come as tokens only (`output_mode: "tokens"`): the workflows decode with their own
tokenizer (rlvr, the agent proxy), so the engine does not render text and per-token strings for
every sample (`Segment.text` is ""), and it does not detokenize at all unless stop strings need
the text (`sampling_params`). The effect on a step shows in `tools/bench_vs_trl.py` and
`tools/bench_async.py`; no bench isolates it.

Errors are typed so the pool can tell a bad request from a dead engine:
- `EngineRequestError`: the engine refused this request (HTTP 4xx: prompt longer than the
  context, invalid sampling parameters, token id out of vocabulary, ...). The engine is fine.
- `EngineUnavailableError`: transport failure or HTTP 5xx (connection refused / reset, engine
  dead). The request may be re-issued elsewhere.
- `EngineAuthError`: HTTP 401 — the token is wrong; a configuration error, never retried.
"""

from __future__ import annotations

import asyncio
import json as _json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

import aiohttp

from mlrl.rollout import vllm_compat
from mlrl.types import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason

if TYPE_CHECKING:  # (mlrl.interfaces imports torch: importing mlrl.rollout stays light)
    from mlrl.interfaces import EnginePauseMode, JSONObject

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineError(RuntimeError):
    """Base class of the errors of one engine call."""


class EngineRequestError(EngineError):
    """The engine refused the request (HTTP 4xx other than 401); the message is the engine's."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineUnavailableError(EngineError):
    """The engine could not be reached or failed internally (transport error, HTTP 5xx)."""


class EngineAuthError(EngineError):
    """HTTP 401: the per-job token was refused."""


@dataclass
class Segment:
    """Output of one generation call (one contiguous piece of a response)."""

    tokens: list[int] = field(default_factory=list)      # [R_seg]
    logprobs: list[float] = field(default_factory=list)  # [R_seg]
    versions: list[int] = field(default_factory=list)    # [R_seg] weight version of each token
    finish: str = "stop"                                 # vLLM finish_reason
    stop_reason: Any = None                              # stop string / token id that ended it
    text: str = ""
    routed_experts: Any = None  # GPU router replay: vLLM's rows for prompt + tokens[:-1] ([n, layers, top_k])


def _routed(text: str | None) -> Any:
    if not text:
        return None
    from mlrl.rollout.routing import decode

    return decode(text)


def sampling_params(
    g: GenerationHyperparameters, *, max_tokens: int | None = None, min_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM SamplingParams (JSON) for one request; logprobs=0 returns the sampled token's logprob only.
    Detokenization is off unless stop strings need it: mlrl asks for tokens only (output_mode
    "tokens") and decodes with its own tokenizer, while vLLM would otherwise still run its
    incremental detokenizer and decode every logprob's token in the API server (a py-spy profile of
    the CPU demo's rollout showed these at ~9% of the API server's time)."""
    sp: dict[str, Any] = {
        "n": 1,
        "max_tokens": g.max_new_tokens if max_tokens is None else max_tokens,
        "min_tokens": g.min_new_tokens if min_tokens is None else min_tokens,
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "logprobs": 0,
    }
    if g.stop_token_ids:
        sp["stop_token_ids"] = list(g.stop_token_ids)
    if g.stop:
        sp["stop"] = list(g.stop)
    sp["detokenize"] = bool(g.stop)
    if g.seed is not None:
        sp["seed"] = int(g.seed)
    return sp


def _versions(spans: list[dict[str, Any]] | None, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's `[{"version", "start", "end"}]` spans (non-integer labels -> default)."""
    out = [default] * n
    for s in spans or []:
        try:
            v = int(s["version"])
        except (TypeError, ValueError):
            v = default
        for i in range(max(0, int(s["start"])), min(n, int(s["end"]))):
            out[i] = v
    return out


GENERATE = "/inference/v1/generate"
BATCH_GENERATE = "/mlrl/generate_batch"  # mlrl.rollout.batch_route.PATH (client.py imports no vLLM)
CLIENT_KEEPALIVE_S = 30.0


def _fail(waiting: list[tuple[Any, asyncio.Future]], err: BaseException) -> None:
    if not isinstance(err, Exception):  # CancelledError & co: the waiters get an engine failure instead
        err = EngineUnavailableError(f"request cancelled: {err!r}")
    for _, f in waiting:
        if not f.done():
            f.set_exception(err)


SERVER_KEEPALIVE_S = 60  # VLLM_HTTP_TIMEOUT_KEEP_ALIVE set by mlrl.rollout.server


class EngineClient:
    """One engine's HTTP API. All methods are coroutines; one instance per engine, shared by all requests.

    HTTP client: aiohttp. httpx was measured first: with hundreds of concurrent requests its
    connection pool (httpcore) rescans every connection per request, and 512 single-token
    generations took 17-19 s against the same vLLM CPU server that aiohttp drives in 2.5 s.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 600.0,
        max_connections: int = 256,
        name: str = "engine",
        vllm: vllm_compat.VllmRelease | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.vllm = vllm or vllm_compat.release()  # the engine's vLLM: the one installed here unless told
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {token}"}
        self._http: aiohttp.ClientSession | None = None  # created on first use, inside the event loop
        # the served model generation requests name: None = the base model; a LoRA adapter's name
        # once the adapter weight sync (weight_sync.lora_mode=adapter) has loaded one
        self.model: str | None = None
        # generate requests waiting for this loop pass's batch (see the module docstring)
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._batched = True   # False once the server said it has no batch route
        self._flushes: set[asyncio.Task] = set()
        self.batched_requests = 0  # generate requests that travelled in a batch (tests, diagnostics)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # idle connections are dropped by the client (30 s) before the server would close them
            # (mlrl starts vLLM with VLLM_HTTP_TIMEOUT_KEEP_ALIVE=60): with equal timeouts a request
            # sent on a connection the server is closing fails with a disconnect
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._http = aiohttp.ClientSession(
                headers=self._headers, connector=connector,
                timeout=aiohttp.ClientTimeout(total=self._timeout_s, connect=10.0))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _request(self, method: str, path: str, *, json: Any = None, params: Any = None,
                       timeout: float | None = None) -> Any:
        kw: dict[str, Any] = {"json": json, "params": params}
        if timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout, connect=10.0)
        try:
            async with self._session().request(method, self.url + path, **kw) as r:
                status, body = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineUnavailableError(f"{self.name} ({self.url}{path}): {type(e).__name__}: {e}") from e
        return self._check(status, body, path)

    async def _post(
        self, path: str, *, json: Any = None, params: Any = None, timeout: float | None = None
    ) -> Any:
        return await self._request("POST", path, json=json, params=params, timeout=timeout)

    async def _get(self, path: str, *, timeout: float | None = None) -> Any:
        return await self._request("GET", path, timeout=timeout)

    def _check(self, status: int, body: bytes, path: str) -> Any:
        if status == 200:
            try:
                return _json.loads(body) if body else None
            except ValueError:  # a few endpoints answer in plain text (/v1/load_lora_adapter)
                return body.decode(errors="replace")
        try:
            parsed = _json.loads(body)
        except ValueError:
            parsed = body[:500].decode(errors="replace")
        raise self._http_error(status, parsed, path)

    def _http_error(self, status: int, parsed: Any, path: str) -> EngineError:
        msg = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        text = f"{self.name} {path}: HTTP {status}: {msg}"
        if status == 401:
            return EngineAuthError(text)
        if 400 <= status < 500:
            return EngineRequestError(text, status)
        return EngineUnavailableError(text)

    # ------------------------------------------------------------------ batched generate requests

    async def _generate(self, body: dict[str, Any]) -> Any:
        """One `/inference/v1/generate` request, sent with the others of this loop pass."""
        if not self._batched:
            return await self._post(GENERATE, json=body)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((body, fut))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        try:
            return await fut
        except asyncio.CancelledError:
            # the caller gave up (a timeout, shutdown): a single request's closed connection would
            # make vLLM abort it; a batched one is aborted by id so the engine stops generating it
            rid = body.get("request_id")
            if rid and all(f is not fut for _, f in self._pending):
                task = asyncio.ensure_future(self._abort_quietly(rid))
                self._flushes.add(task)
                task.add_done_callback(self._flushes.discard)
            raise

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.abort([request_id])
        except EngineError:  # the engine is gone or the request already finished: nothing to stop
            pass

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: list[tuple[dict[str, Any], asyncio.Future]]) -> None:
        live = [(b, f) for b, f in batch if not f.done()]  # a caller cancelled (timeout) before the send
        if len(live) <= 1 or not self._batched:
            await asyncio.gather(*(self._send_one(b, f) for b, f in live))
            return
        try:
            js = await self._post(BATCH_GENERATE, json={"requests": [b for b, _ in live]})
            answers = js["responses"] if isinstance(js, dict) else None
            if not isinstance(answers, list) or len(answers) != len(live):
                raise EngineUnavailableError(f"{self.name} {BATCH_GENERATE}: {len(live)} requests, malformed answer "
                                             f"{str(js)[:200]}")
        except EngineRequestError as e:
            if e.status not in (404, 405):
                _fail(live, e)
                return
            self._batched = False  # a server without the route: one request each from now on
            await asyncio.gather(*(self._send_one(b, f) for b, f in live))
            return
        except Exception as e:  # every request of the batch gets the engine's failure
            _fail(live, e)
            return
        except BaseException as e:  # cancelled (shutdown): the waiters are told, then it propagates
            _fail(live, e)
            raise
        self.batched_requests += len(live)
        for (_, f), a in zip(live, answers):
            if f.done():
                continue
            if isinstance(a, dict) and "error" in a and "choices" not in a:
                f.set_exception(self._http_error(int(a.get("status", 500)), a, GENERATE))
            else:
                f.set_result(a)

    async def _send_one(self, body: dict[str, Any], fut: asyncio.Future) -> None:
        try:
            result = await self._post(GENERATE, json=body)
        except BaseException as e:
            _fail([(body, fut)], e)
            if not isinstance(e, Exception):
                raise
        else:
            if not fut.done():
                fut.set_result(result)

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], gconfig: GenerationHyperparameters, *, request_id: str,
                       default_version: int, max_tokens: int | None = None, min_tokens: int | None = None) -> Segment:
        return (await self.generate_n(prompt_ids, gconfig, 1, request_id=request_id, default_version=default_version,
                                      max_tokens=max_tokens, min_tokens=min_tokens))[0]

    async def generate_n(self, prompt_ids: list[int], gconfig: GenerationHyperparameters, n: int, *,
                         request_id: str, default_version: int, max_tokens: int | None = None,
                         min_tokens: int | None = None) -> list[Segment]:
        """n samples of one prompt in one request (vLLM's `n`: the prompt is prefilled once; with a
        seed, sample i uses seed + i). One Segment per sample, in order."""
        sp = sampling_params(gconfig, max_tokens=max_tokens, min_tokens=min_tokens)
        sp["n"] = n
        body = {"request_id": request_id, "token_ids": list(prompt_ids), "output_mode": "tokens", "sampling_params": sp}
        if self.model is not None:
            body["model"] = self.model
        js = await self._generate(body)
        try:
            choices = sorted(js["choices"], key=lambda c: c.get("index", 0))
            segs = [self._segment(ch, default_version) for ch in choices]
        except (KeyError, IndexError, TypeError) as e:
            raise EngineUnavailableError(
                f"{self.name}: malformed /inference/v1/generate answer ({e}): {str(js)[:300]}"
            ) from e
        if len(segs) != n:
            raise EngineUnavailableError(f"{self.name}: asked for {n} samples, the answer has {len(segs)}")
        return segs

    def _segment(self, ch: dict[str, Any], default_version: int) -> Segment:
        tokens = list(ch.get("token_ids") or [])
        content = (ch.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(tokens):
            raise EngineUnavailableError(
                f"{self.name}: {len(tokens)} tokens but {len(logprobs)} logprobs in the answer")
        return Segment(tokens=tokens, logprobs=logprobs,
                       versions=_versions(ch.get("weight_versions"), len(tokens), default_version),
                       finish=ch.get("finish_reason") or "stop", stop_reason=ch.get("stop_reason"),
                       text=ch.get("text") or "", routed_experts=_routed(ch.get("routed_experts")))

    async def agenerate(self, req: ModelRequest, *, default_version: int = 0) -> ModelResponse:
        """One request on this engine alone (no failover, no resume: that is the pool's job).
        A refused request returns stop_reason ERROR with the engine's message; an unreachable
        engine raises EngineUnavailableError."""
        t0 = time.monotonic()
        resp = ModelResponse(input_tokens=list(req.input_ids), rid=req.rid, engine=self.name)
        try:
            seg = await self.generate(req.input_ids, req.gconfig, request_id=req.rid, default_version=default_version)
        except (EngineRequestError, EngineAuthError) as err:
            resp.stop_reason, resp.error = StopReason.ERROR, str(err)
        else:
            resp.output_tokens, resp.output_logprobs, resp.output_versions, resp.text = (
                seg.tokens,
                seg.logprobs,
                seg.versions,
                seg.text,
            )
            resp.stop_reason = {"length": StopReason.LENGTH, "abort": StopReason.ABORT, "error": StopReason.ERROR}.get(
                seg.finish, StopReason.STOP
            )
        resp.latency = time.monotonic() - t0
        return resp

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """logprob of token i given tokens[:i], for i = 1..len-1 (teacher forcing; raw logits, temperature 1)."""
        body = {
            "token_ids": list(token_ids),
            "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0, "detokenize": False},
        }
        if self.model is not None:
            body["model"] = self.model
        js = await self._generate(body)
        out = []
        for tok, entry in zip(token_ids[1:], (js.get("prompt_logprobs") or [None])[1:]):
            if not entry or str(tok) not in entry:
                raise EngineUnavailableError(f"{self.name}: no prompt logprob for token {tok} in the answer")
            out.append(float(entry[str(tok)]["logprob"]))
        if len(out) != len(token_ids) - 1:
            raise EngineUnavailableError(f"{self.name}: expected {len(token_ids) - 1} prompt logprobs, got {len(out)}")
        return out

    async def classify(self, token_ids: list[int]) -> list[float]:
        """A pooling engine's (`--runner pooling`) class probabilities for one sequence (vLLM's
        /classify; one label: the sigmoid of the reward model's score)."""
        body: dict[str, Any] = {"input": [list(token_ids)]}
        if self.model is not None:
            body["model"] = self.model
        js = await self._post("/classify", json=body)
        try:
            return [float(p) for p in js["data"][0]["probs"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"{self.name}: /classify answered {str(js)[:200]}") from None

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return list((await self._post("/tokenize", json=body))["tokens"])

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests by the ids given to `generate` (they return with finish_reason "abort")."""
        if request_ids:
            await self._post("/abort_requests", json={"request_ids": list(request_ids)})

    # ------------------------------------------------------------------ control

    async def health(self) -> bool:
        try:
            await self._get("/health", timeout=5.0)
            return True
        except EngineError:
            return False

    async def pause(self, mode: EnginePauseMode = "wait", *, timeout: float | None = None) -> None:
        await self._post("/pause", params={"mode": mode}, timeout=timeout)

    async def resume(self) -> None:
        await self._post("/resume")

    async def is_paused(self) -> bool:
        return bool((await self._get("/is_paused"))["is_paused"])

    async def sleep(self, level: int = 1, mode: EnginePauseMode = "wait") -> None:
        """vLLM sleep mode (`/sleep`): scheduling paused, prefix cache cleared; on GPU level 1 moves
        the weights to host memory and discards the KV cache, level 2 discards both. The CPU build
        accepts the call but its worker keeps all memory (vllm/v1/worker/cpu_worker.py: sleep is
        "not supported on CPU, ignore it")."""
        await self._post("/sleep", params={"level": str(level), "mode": mode})

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """`/wake_up` (all memory, or only `tags`: "weights", "kv_cache"); True once fully awake
        (vLLM resumes scheduling then)."""
        params = [("tags", t) for t in tags] if tags else None
        js = await self._post("/wake_up", params=params)
        if isinstance(js, dict) and "status" in js:
            return js["status"] == "awake"
        return not await self.is_sleeping()  # vLLM 0.26 answers an empty body

    async def is_sleeping(self) -> bool:
        return bool((await self._get("/is_sleeping"))["is_sleeping"])

    async def set_weight_version(self, version: int) -> None:
        """Label the engine's next tokens with `version` (vLLM 0.26 has no labels: a no-op, see the
        module docstring)."""
        if self.vllm.has(vllm_compat.Feature.WEIGHT_VERSIONS):
            await self._post("/update_weight_version", json={"new_version": str(version)})

    async def weight_version(self) -> str:
        self.vllm.require(vllm_compat.Feature.WEIGHT_VERSIONS)
        return str((await self._get("/weight_info"))["weight_version"])

    async def reset_prefix_cache(self) -> bool:
        return bool((await self._post("/reset_prefix_cache"))["success"])

    async def init_weight_transfer(self, init_info: JSONObject, *, timeout: float | None = None) -> None:
        await self._post("/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout)

    async def shutdown_weight_transfer(self) -> None:
        if self.vllm.has(vllm_compat.Feature.SHUTDOWN_WEIGHT_TRANSFER_ROUTE):
            await self._post("/shutdown_weight_transfer_engine")
        else:  # the worker extension does what the route does (mlrl.rollout.worker_ext)
            await self.collective_rpc("mlrl_shutdown_weight_transfer")

    async def start_weight_update(self) -> None:
        await self._post("/start_weight_update")

    async def update_weights(self, update_info: JSONObject, *, timeout: float | None = None) -> None:
        await self._post("/update_weights", json={"update_info": update_info}, timeout=timeout)

    async def finish_weight_update(self, version: int, *, timeout: float | None = None) -> None:
        await self._post("/finish_weight_update", json={"weight_version": str(version)}, timeout=timeout)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT folder `path` as the served model `name` (vLLM's runtime LoRA loading).
        Never `load_inplace` (measured on vLLM 0.32 CPU): an adapter loaded in place is re-read from
        disk on every engine step from then on, requests already running switch weights mid-sequence,
        and the prefix cache, keyed by (name, path), serves KV of the old weights. A name already
        loaded is an EngineRequestError: unload it first."""
        await self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", json={"lora_name": name})

    async def routing_enable(self, max_bytes: int = 256 << 20) -> dict[str, Any]:
        """Start capturing routed experts in this engine's workers (CPU path, mlrl.rollout.routing)."""
        return (await self.collective_rpc("mlrl_routing_enable", args=[str(max_bytes)]))[0]

    async def routing_take(self, queries: Sequence[Sequence[int]]) -> list[Any]:
        """Routed-expert rows ([m, layers, top_k] numpy) of each token sequence, None where this
        engine has none. Every worker of a TP engine routes identically: the first one answers."""
        from mlrl.rollout.routing import decode

        res = (await self.collective_rpc("mlrl_routing_take", args=[_json.dumps([list(q) for q in queries])]))[0]
        return [None if r is None else decode(r) for r in res["rows"]]

    async def collective_rpc(self, method: str, *, args: list[str] | None = None, kwargs: dict[str, str] | None = None,
                             timeout: float | None = None) -> list[Any]:
        """Call a worker(-extension) method on every worker of this engine; one result per worker."""
        body: dict[str, Any] = {"method": method, "args": list(args or []), "kwargs": dict(kwargs or {})}
        js = await self._post("/collective_rpc", json=body, timeout=timeout)
        return list((js or {}).get("results", []))
