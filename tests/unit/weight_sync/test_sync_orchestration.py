"""WeightSync without vLLM: disk transport round trip, report verification, canary with retry-once,
failure leaves the pool paused, the refresh hook; HFWeightSource (tied weights sent once, canary
logprobs); transport names resolved in one place (the registry)."""

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
import torch
from helpers.one_engine_pool import OneEnginePool
from helpers.tools import load_tool

from mlrl.config.schema import WeightSyncConfig
from mlrl.weight_sync import (
    TRANSPORTS,
    SendReport,
    UnknownTransportError,
    WeightSyncError,
    make_weight_sync,
    push_from_rank,
)
from mlrl.weight_sync.receiver import Receiver
from mlrl.weight_sync.sender import bucketize
from mlrl.weight_sync.source import PushRequest
from mlrl.weight_sync.sync import _Mismatch, canary_tokens, verify_reports
from mlrl.weight_sync.transports import receive_disk
from mlrl.weight_sync.wire import WireError

HFWeightSource = load_tool("hf_weight_source").HFWeightSource  # shared with tools/bench_weight_sync.py

VOCAB = 24


class TinyLM(torch.nn.Module):
    """Embedding -> linear -> tied LM head: enough to have HF-style names, tied weights and logits."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids):
        h = torch.tanh(self.mix(self.embed(input_ids))).cumsum(1)

        class Out:
            logits = self.lm_head(h)
        return Out


def _buckets(named, bucket_bytes=64):
    return lambda n: bucketize(iter(named), bucket_bytes)


def test_disk_round_trip_and_tampering(tmp_path):
    named = [("a", torch.randn(5, 3)), ("b", torch.arange(7)), ("c", torch.randn(4).to(torch.bfloat16))]
    req = PushRequest("disk", 3, bucket_bytes=40, disk_dir=str(tmp_path / "v3"))
    rep = push_from_rank(req, _buckets(named, 40), 0)
    assert rep.tensors == 3 and len(rep.files) >= 2 and (tmp_path / "v3" / "s00.done").is_file()
    got = {}
    streams = receive_disk(tmp_path / "v3", 1, lambda b: got.update(dict(b)))
    assert streams[0]["digest"] == rep.digest and streams[0]["bytes"] == rep.bytes
    assert all(torch.equal(got[n], t) for n, t in named)
    with pytest.raises(WireError, match="s01.done is missing"):
        receive_disk(tmp_path / "v3", 2, lambda b: None)
    # corrupt one stored checksum: the reader must refuse the file
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    f = tmp_path / "v3" / rep.files[0]
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    checks = json.loads(meta["mlrl_checksums"])
    checks[next(iter(checks))] = "crc32:00000000"
    save_file(load_file(str(f)), str(f), metadata={**meta, "mlrl_checksums": json.dumps(checks)})
    with pytest.raises(WireError, match="checksum mismatch"):
        receive_disk(tmp_path / "v3", 1, lambda b: None)


def test_verify_reports_catches_every_kind_of_mismatch():
    class E:
        name = "engine-0"

    sent = [
        SendReport(0, "broadcast", tensors=3, bytes=100, digest="d0"),
        SendReport(1, "broadcast", tensors=2, bytes=50, digest="d1"),
    ]
    good = {
        "worker": 0,
        "version": 4,
        "missing": [],
        "finalize_s": 0.5,
        "streams": [
            {"sender": 0, "tensors": 3, "bytes": 100, "digest": "d0"},
            {"sender": 1, "tensors": 2, "bytes": 50, "digest": "d1"},
        ],
    }
    assert verify_reports(sent, [E()], [[good, dict(good, worker=1)]], 4) == (5, 150, 0.5)
    bad_digest = json.loads(json.dumps(good))
    bad_digest["streams"][1]["digest"] = "xx"
    cases = [
        ([bad_digest], "from sender 1"),
        ([dict(good, version=3)], "version 3"),
        ([dict(good, missing=["lm_head.weight"])], "received no tensor"),
        ([dict(good, streams=good["streams"][:1])], "streams from senders"),
        ([], "no weight report"),
    ]
    for workers, msg in cases:
        with pytest.raises(_Mismatch, match=msg):
            verify_reports(sent, [E()], [workers], 4)


def test_hf_source_sends_tied_weights_once_and_computes_canary_logprobs():
    m = TinyLM()
    src = HFWeightSource(m)
    names = [n for n, _ in src.named_tensors()]
    assert names == ["embed.weight", "mix.weight", "mix.bias"]
    prompt, completion = canary_tokens(VOCAB)
    assert len(prompt) == 8 and len(completion) == 16 and all(0 <= t < VOCAB for t in prompt + completion)
    lp = src.canary_logprobs(prompt, completion)
    with torch.no_grad():
        full = torch.log_softmax(m(torch.tensor([prompt + completion])).logits[0], -1)
    assert lp == pytest.approx([float(full[7 + i, t]) for i, t in enumerate(completion)], abs=1e-6)


class FakeClient:
    """Control API of one engine; its 'model' is a dict filled through the real disk receiver."""

    def __init__(self, canary_values):
        self.model: dict[str, torch.Tensor] = {}
        self.receiver = Receiver()
        self.canary_values = canary_values  # list of lists returned by successive prompt_logprobs calls
        self.calls = []
        self._report = None

    async def pause(self, mode="wait", **kw):
        self.calls.append(("pause", mode))

    async def resume(self):
        self.calls.append(("resume",))

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, info, timeout=None):
        rep = self.receiver.receive(info, lambda b: self.model.update(dict(b)))
        self._report = {
            "worker": 0,
            "version": info["version"],
            "missing": [],
            "streams": rep["streams"],
            "finalize_s": 0.0,
        }

    async def finish_weight_update(self, version, timeout=None):
        self.calls.append(("finish", version))

    async def collective_rpc(self, method, **kw):
        assert method == "mlrl_weight_report"
        return [self._report]

    async def reset_prefix_cache(self):
        return True

    async def prompt_logprobs(self, ids):
        return self.canary_values.pop(0)


async def test_disk_sync_verifies_and_retries_the_canary_once(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    wrong = [v + 0.5 for v in want]
    client = FakeClient([[0.0] * 8 + wrong, [0.0] * 8 + want])  # first canary off, second right
    pool = OneEnginePool(client)
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=1e-5, bucket_mb=1e-4), pool, src,
                          model_dir=tmp_path, run_dir=tmp_path)
    assert pool.refresher is None  # make_weight_sync leaves the pool alone; the caller wires the refresh hook
    pool.refresher = ws.refresh
    rep = await ws.sync(1)
    assert rep.attempts == 2 and rep.version == 1 and rep.canary_max_abs_diff < 1e-6
    assert rep.tensors == 3 and dict(rep)["weight_sync/attempts"] == 2.0
    assert pool.events == ["pause", ("commit", 1), "resume"] and pool.version == 1
    assert all(torch.equal(client.model[n], t) for n, t in src.named_tensors())
    assert sorted(p.name for p in (tmp_path / "weight_sync").iterdir()) == ["v00000001"]
    # the pool's refresher (ws.refresh, for restarted engines) re-syncs the pool's
    # current version in full: an engine that lost its weights gets every tensor again
    client.model.clear()
    client.canary_values.append([0.0] * 8 + want)
    await pool.refresher()
    assert pool.events[3:] == ["pause", ("commit", 1), "resume"] and pool.version == 1
    assert all(torch.equal(client.model[n], t) for n, t in src.named_tensors())


@pytest.mark.parametrize("bucket_mb,files", [(1e-4, 3), (64.0, 1)])
async def test_bucket_mb_sets_how_the_weights_are_cut(tmp_path, bucket_mb, files):
    """weight_sync.bucket_mb: the disk transport writes one safetensors file per bucket; ~100 bytes
    cut TinyLM's 3 tensors apart, 64 MB carries them in one."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    client = FakeClient([[0.0] * 8 + src.canary_logprobs(*canary_tokens(VOCAB))])
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=1e-5, bucket_mb=bucket_mb),
                          OneEnginePool(client), src, model_dir=tmp_path, run_dir=tmp_path)
    rep = await ws.sync(1)
    assert rep.tensors == 3 and all(torch.equal(client.model[n], t) for n, t in src.named_tensors())
    assert len(list((tmp_path / "weight_sync" / "v00000001").glob("*.safetensors"))) == files


async def test_second_failure_raises_and_leaves_the_pool_paused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    bad = [[0.0] * 24, [0.0] * 24]
    pool = OneEnginePool(FakeClient(bad))
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=1e-3), pool, src,
                          model_dir=tmp_path, run_dir=tmp_path)
    with pytest.raises(WeightSyncError, match=r"failed twice.*canary logprobs differ"):
        await ws.sync(1)
    assert pool.paused and pool.version == 0 and "resume" not in pool.events


class _RecordingSource:
    """`src` that records the order of its trainer calls ("reference", "push") and flags the reference's start."""

    num_senders = 1

    def __init__(self, src, order, started):
        self.src, self.order, self.started = src, order, started

    def canary_logprobs(self, prompt, completion):
        self.order.append("reference")
        self.started.set()
        return self.src.canary_logprobs(prompt, completion)

    def push(self, request):
        self.order.append("push")
        return self.src.push(request)


async def test_the_trainers_canary_reference_runs_while_the_engines_pause(tmp_path):
    """The canary reference needs only the trainer: it starts before the pool's pause returns (vLLM's
    pause alone sleeps 20 ms), and still precedes the transfer. Colocated hooks keep it after them."""
    import asyncio
    import threading

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    order, started = [], threading.Event()

    class SlowPool(OneEnginePool):
        async def pause(self, mode=None):
            order.append("pause start")
            await asyncio.to_thread(started.wait, 5)  # returns only once the reference has started
            order.append("pause end")
            await super().pause(mode)

    pool = SlowPool(FakeClient([[0.0] * 8 + want] * 2))
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=1e-5), pool,
                          _RecordingSource(src, order, started), model_dir=tmp_path, run_dir=tmp_path)
    rep = await ws.sync(1)
    assert rep.canary_checked and rep.canary_max_abs_diff < 1e-6
    assert order.index("reference") < order.index("pause end") < order.index("push")

    class Hooks:
        async def before_transfer(self):
            order.append("hook")

        async def before_verify(self):
            pass

    order.clear()
    started.set()
    await ws.sync(2, hooks=Hooks())
    assert order.index("pause end") < order.index("hook") < order.index("reference") < order.index("push")


async def test_with_the_pool_already_paused_the_canary_reference_overlaps_the_engines_load(tmp_path):
    """Paused engines (the sync loop pauses them while the trainer trains): nothing to overlap at
    the pause, so the reference starts once the trainer's push returned, while the engines still
    load and finish; and it is awaited before the canary compares."""
    import asyncio
    import threading

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    order, started = [], threading.Event()

    class SlowClient(FakeClient):
        async def update_weights(self, info, timeout=None):
            await asyncio.to_thread(started.wait, 5)  # the engine loads only once the reference has started
            order.append("engine load")
            await super().update_weights(info, timeout=timeout)

    pool = OneEnginePool(SlowClient([[0.0] * 8 + want] * 2))
    pool.paused = True
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=1e-5), pool,
                          _RecordingSource(src, order, started), model_dir=tmp_path, run_dir=tmp_path)
    rep = await ws.sync(1)
    assert rep.canary_checked and rep.canary_max_abs_diff < 1e-6
    assert order == ["push", "reference", "engine load"]

    # a canary off by more than the tolerance is still caught (and retried once) on this path
    order.clear()
    pool.paused = True
    pool.engines[0].client.canary_values[:] = [[0.0] * 8 + [v + 0.5 for v in want], [0.0] * 8 + want]
    rep = await ws.sync(2)
    assert rep.attempts == 2 and rep.canary_max_abs_diff < 1e-6
    assert order[:2] == ["push", "reference"] and order.count("reference") == 2  # the retry: reference first


async def test_check_loaded_moves_nothing_when_the_engines_agree_and_declines_otherwise(tmp_path):
    """weight_sync.first_sync=auto: engines that loaded the trainer's starting weights are checked by
    the canary alone (0 bytes, the version committed); a disagreeing canary or a canary that is off
    returns None (the run then pushes, `sync`), leaving the pool's version alone."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    client = FakeClient([[0.0] * 8 + want, [0.0] * 8 + want])
    cfg = WeightSyncConfig(transport="disk", canary_tolerance=1e-5)

    pool = OneEnginePool(client)
    ws = make_weight_sync(cfg, pool, src, model_dir=tmp_path, run_dir=tmp_path)
    rep = await ws.check_loaded(0)
    assert rep is not None and rep.transport == "loaded" and rep.bytes == 0 and rep.tensors == 0
    assert rep.canary_checked and rep.canary_max_abs_diff < 1e-6 and rep.engines == 1
    assert pool.events == [("commit", 0)] and client.model == {}  # nothing paused, nothing received
    # the next (full) sync measures how far the engines moved from the checked canary
    rep1 = await ws.sync(1)
    assert rep1.bytes > 0 and rep1.attempts == 1 and rep1.canary_moved == pytest.approx(0.0, abs=1e-6)

    pool2 = OneEnginePool(FakeClient([[0.0] * 8 + [v + 0.5 for v in want]]))
    ws2 = make_weight_sync(cfg, pool2, src, model_dir=tmp_path, run_dir=tmp_path)
    assert await ws2.check_loaded(0) is None and pool2.events == [] and ws2.history == []

    # an engine's NaN is no agreement (max() passed over it: nan > tolerance is false)
    nan_first = [float("nan")] + want[1:]
    pool_nan = OneEnginePool(FakeClient([[0.0] * 8 + nan_first]))
    ws_nan = make_weight_sync(cfg, pool_nan, src, model_dir=tmp_path, run_dir=tmp_path)
    assert await ws_nan.check_loaded(0) is None and pool_nan.events == []

    pool3 = OneEnginePool(FakeClient([]))  # canary off: nothing can be checked, no engine call is made
    ws3 = make_weight_sync(WeightSyncConfig(transport="disk", canary_tolerance=0.0), pool3, src,
                           model_dir=tmp_path, run_dir=tmp_path)
    assert await ws3.check_loaded(0) is None and pool3.events == []


async def test_check_loaded_calls_the_colocated_hooks_around_the_trainers_reference(tmp_path):
    """A colocated start (mlrl.colocation.first_sync): the engines' weights wake before the trainer's
    canary logprobs, and the trainer's parameters may leave (before_verify) before the engines are
    asked, as in a sync; no hook is called when the canary is off."""
    import threading

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    order = []

    class Client(FakeClient):
        async def prompt_logprobs(self, ids):
            order.append("engine canary")
            return await super().prompt_logprobs(ids)

    class Hooks:
        async def before_transfer(self):
            order.append("before_transfer")

        async def before_verify(self):
            order.append("before_verify")

    cfg = WeightSyncConfig(transport="disk", canary_tolerance=1e-5)
    recording = _RecordingSource(src, order, threading.Event())
    ws = make_weight_sync(cfg, OneEnginePool(Client([[0.0] * 8 + want])), recording, model_dir=tmp_path,
                          run_dir=tmp_path)
    rep = await ws.check_loaded(0, hooks=Hooks())
    assert rep is not None and rep.transport == "loaded"
    assert order == ["before_transfer", "reference", "before_verify", "engine canary"]
    off = make_weight_sync(dataclasses.replace(cfg, canary_tolerance=0.0), OneEnginePool(Client([])), src,
                           model_dir=tmp_path, run_dir=tmp_path)
    order.clear()
    assert await off.check_loaded(0, hooks=Hooks()) is None and order == []


def test_transport_names_are_resolved_in_one_place(tmp_path):
    # every name the config accepts has its three parts, and nothing else is registered
    hints = typing.get_type_hints(WeightSyncConfig)
    assert set(TRANSPORTS) == set(typing.get_args(hints["transport"])) == {"broadcast", "disk", "cuda_ipc"}
    for name, t in TRANSPORTS.items():
        assert t.name == name and t.driver.transport == name and callable(t.send) and callable(t.receive)
    # an unknown name fails the same way on the driver, on a trainer rank and on an engine worker
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    known = "known: broadcast, disk, cuda_ipc"
    with pytest.raises(UnknownTransportError, match=known):
        make_weight_sync(WeightSyncConfig(transport="raw"), OneEnginePool(FakeClient([])), HFWeightSource(TinyLM()),
                         model_dir=tmp_path)
    for sender in (0, None):
        with pytest.raises(UnknownTransportError, match=known):
            push_from_rank(PushRequest("raw", 1), _buckets([]), sender)
    with pytest.raises(UnknownTransportError, match=known):
        Receiver().receive({"transport": "raw", "version": 1}, lambda b: None)
    with pytest.raises(UnknownTransportError, match=r"unknown None"):
        Receiver().receive({"mode": "disk", "version": 1}, lambda b: None)  # the old key is not read


def test_disk_needs_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    with pytest.raises(ValueError, match="disk_dir or a run dir"):
        make_weight_sync(WeightSyncConfig(transport="disk"), OneEnginePool(FakeClient([])), HFWeightSource(TinyLM()),
                         model_dir=tmp_path)
    ws = make_weight_sync(WeightSyncConfig(transport="disk", disk_dir=str(tmp_path / "d")),
                          OneEnginePool(FakeClient([])), HFWeightSource(TinyLM()), model_dir=tmp_path,
                          run_dir=tmp_path / "run")
    assert ws.root == tmp_path / "d"


def test_weight_sync_does_not_import_the_rollout_package():
    """The package and its torch-only receiver (which runs inside vLLM) load neither mlrl.rollout
    nor vllm: the dependency goes rollout -> weight_sync only. (The benchmark's reference, which
    does reach into the engines, lives in tools/weight_sync_reference.py.)"""
    code = ("import sys, mlrl.weight_sync, mlrl.weight_sync.receiver; "
            "assert 'mlrl.weight_sync.transports' in sys.modules; "  # the import did load the package
            "bad = sorted(m for m in sys.modules if m.startswith('mlrl.rollout') or m.split('.')[0] == 'vllm'); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("every,checked", [(1, [1, 2, 3, 4]), (2, [1, 2, 4])])
async def test_canary_every_n_versions(tmp_path, every, checked):
    """weight_sync.canary_every: the canary runs on every Nth version and always on the run's first sync
    (version 1 here); a sync without it reports no gap. Checksums are verified on every sync either way."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    want = src.canary_logprobs(*canary_tokens(VOCAB))
    client = FakeClient([[0.0] * 8 + want for _ in range(4)])
    ws = make_weight_sync(WeightSyncConfig(transport="disk", canary_every=every), OneEnginePool(client), src,
                          model_dir=tmp_path, run_dir=tmp_path)
    reps = [await ws.sync(v) for v in (1, 2, 3, 4)]
    assert [r.version for r in reps if r.canary_checked] == checked
    assert all(("weight_sync/canary_max_abs_diff" in dict(r)) == r.canary_checked for r in reps)
    assert all(r.tensors == 3 for r in reps)  # every sync still verified what arrived
    assert len(client.canary_values) == 4 - len(checked)  # the engines were asked exactly that often


@pytest.mark.parametrize(("dtype", "passes"), [("float32", False), ("bfloat16", True)])
async def test_the_default_canary_tolerance_follows_the_model_dtype(tmp_path, dtype, passes):
    """The bf16 gap an H200 showed between Megatron+TE and vLLM right after an exact first sync
    (0.0197 on a random Qwen3-1.7B shape) fails a float32 run's default tolerance (1e-3: there it
    is a real mismatch) and passes a bf16 run's (5e-2, mlrl.config.schema.CANARY_TOLERANCE), as
    mlrl.jobs.rl resolves it; an explicit tolerance wins over either."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    src = HFWeightSource(TinyLM())
    off = [v + 0.0197 for v in src.canary_logprobs(*canary_tokens(VOCAB))]
    cfg = WeightSyncConfig(transport="disk")
    assert cfg.canary_tolerance is None
    resolved = dataclasses.replace(cfg, canary_tolerance=cfg.canary_tolerance_for(dtype))
    pool = OneEnginePool(FakeClient([[0.0] * 8 + off, [0.0] * 8 + off]))
    ws = make_weight_sync(resolved, pool, src, model_dir=tmp_path, run_dir=tmp_path)
    if passes:
        assert (await ws.sync(1)).canary_max_abs_diff == pytest.approx(0.0197, abs=1e-6)
    else:
        with pytest.raises(WeightSyncError, match=r"by 0\.0197 > weight_sync\.canary_tolerance=0\.001"):
            await ws.sync(1)
    assert WeightSyncConfig(canary_tolerance=0.3).canary_tolerance_for(dtype) == 0.3


async def test_a_failed_engine_call_raises_only_once_every_engine_call_ended():
    """disk / cuda_ipc drive every engine at once: a plain gather raised at the first failure and
    left the other engines' update calls running, into the retry's start_weight_update (or past
    cuda_ipc's release of the handles they were reading)."""
    import asyncio

    from mlrl.weight_sync.sync import gather_all

    ended = []

    async def slow_ok():
        await asyncio.sleep(0.2)
        ended.append("slow")
        return 1

    async def fails():
        raise ConnectionError("engine-1 died")

    with pytest.raises(ConnectionError, match="engine-1 died"):
        await gather_all([slow_ok(), fails()])
    assert ended == ["slow"]
    assert await gather_all([slow_ok(), slow_ok()]) == [1, 1]
