"""Server launch: the vLLM command / environment, start-up failures with the log tail, clean stop,
no orphans when the launcher dies; the token middleware."""

import asyncio
import dataclasses
import getpass
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.tools import load_tool
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlrl.config.schema import RolloutConfig
from mlrl.rollout.auth import TOKEN_ENV, TokenMiddleware
from mlrl.rollout.server import EngineServer, EngineStartError, ServerSpec, server_command, server_env
from mlrl.rollout.supervisor import pids_in_group


def _spec(tmp_path, **kw) -> ServerSpec:
    cfg = RolloutConfig(host="127.0.0.1", engine_tp=2, max_model_len=512, cpu_kv_cache_gb=2.0)
    return ServerSpec.from_config(
        cfg, "engine-7", "/models/m", "float32", "s3cret-token", log_path=str(tmp_path / "e.log"), omp_threads=1, **kw
    )


def test_command_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = _spec(tmp_path)
    cmd = server_command(spec, 8123)
    assert cmd[1:3] == ["-m", "mlrl.rollout.vllm_main"]  # vLLM's OpenAI server, see vllm_main.py
    args = dict(zip(cmd[3::1], cmd[4::1]))
    assert args["--model"] == "/models/m" and args["--dtype"] == "float32" and args["--host"] == "127.0.0.1"
    assert args["--port"] == "8123" and args["--tensor-parallel-size"] == "2" and args["--max-model-len"] == "512"
    assert args["--worker-extension-cls"] == "mlrl.rollout.worker_ext.MlrlWorkerExtension"
    assert json.loads(args["--weight-transfer-config"]) == {"backend": "mlrl"}
    # the token check is the last --middleware (vLLM wraps in order: it runs first), the batch route before it
    mw = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"]
    assert mw == ["mlrl.rollout.batch_route.BatchGenerateMiddleware", "mlrl.rollout.auth.TokenMiddleware"]
    assert "--enforce-eager" in cmd and "--enable-scale-out" in cmd
    # vLLM's stat loggers are off unless rollout.engine_log_stats asks for them
    assert "--disable-log-stats" in cmd
    stats = ServerSpec.from_config(RolloutConfig(engine_log_stats=True), "e", "/models/m", "float32", "t")
    assert "--disable-log-stats" not in server_command(stats, 8123)
    assert not any("s3cret" in a for a in cmd), "the token must not appear in argv"
    # a CPU engine with one worker runs it in the engine-core process (no busy-polling worker process)
    assert "--distributed-executor-backend" not in cmd  # engine_tp=2 here: vLLM's multi-process default
    one = server_command(dataclasses.replace(spec, engine_tp=1), 8123)
    assert one[one.index("--distributed-executor-backend") + 1] == "uni"
    # ...and vllm-cpu keeps it "uni" only with V1 multiprocessing off (platforms/cpu.py)
    assert server_env(dataclasses.replace(spec, engine_tp=1))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # ...and its engine core is forked from the API server (vllm_main.py), not spawned
    assert server_env(dataclasses.replace(spec, engine_tp=1))["MLRL_ENGINE_FORK"] == "1"
    env = server_env(spec)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # engine_tp=2: vLLM's mp workers
    assert "MLRL_ENGINE_FORK" not in env  # ...which vllm-cpu spawns (each binds its own OpenMP threads)
    assert env[TOKEN_ENV] == "s3cret-token" and env["VLLM_SERVER_DEV_MODE"] == "1"
    # the client drops idle connections before the server does (no request on a closing connection)
    from mlrl.rollout.client import CLIENT_KEEPALIVE_S
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > CLIENT_KEEPALIVE_S
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    assert (
        env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        and env["OMP_NUM_THREADS"] == "1"
    )
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # an explicit user choice wins
    assert server_env(spec)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_a_benchmark_starts_engines_with_its_own_worker_extension(tmp_path, monkeypatch):
    """ServerSpec.worker_extension replaces mlrl's class: tools/bench_weight_sync.py's engines get a
    subclass with its reference hook, importable inside the engine through PYTHONPATH alone."""
    assert server_command(dataclasses.replace(_spec(tmp_path), worker_extension="m.Ext"), 8123).count("m.Ext") == 1
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    ref = load_tool("weight_sync_reference")
    spec = ref.engine_server(0, _spec(tmp_path)).spec
    cmd, env = server_command(spec, 8123), server_env(spec)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == ref.WORKER_EXTENSION
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ref.TOOLS), "/elsewhere"]
    pytest.importorskip("vllm")
    code = textwrap.dedent(f"""
        import importlib
        from mlrl.rollout.worker_ext import MlrlWorkerExtension
        module, name = {ref.WORKER_EXTENSION!r}.rsplit(".", 1)  # as vLLM resolves --worker-extension-cls
        ext = getattr(importlib.import_module(module), name)
        assert issubclass(ext, MlrlWorkerExtension) and callable(getattr(ext, {ref.WORKER_HOOK!r}))
    """)
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)


def test_start_failure_raises_with_the_log_tail(tmp_path):
    spec = _spec(
        tmp_path,
        command=[sys.executable, "-c", "import sys; print('ValueError: no such model /models/m'); sys.exit(3)"],
    )
    srv = EngineServer(spec)
    srv.start()
    with pytest.raises(EngineStartError, match=r"(?s)engine-7.*exited with code 3.*no such model"):
        srv.wait_ready(30)
    assert not srv.alive()


def test_readiness_timeout_leaves_no_process(tmp_path):
    child = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    srv = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", child]))
    srv.start()
    for _ in range(100):
        pgid = srv._server_pgid()
        if pgid and len(pids_in_group(pgid)) == 2:
            break
        time.sleep(0.05)
    assert len(pids_in_group(pgid)) == 2  # the server and its child run: the check below is not vacuous
    with pytest.raises(EngineStartError, match="not ready after 1 s"):
        srv.wait_ready(1.0)
    assert pids_in_group(pgid) == []


def test_no_orphans_when_the_launcher_is_killed(tmp_path):
    launcher = textwrap.dedent(f"""
        import sys, time
        from mlrl.rollout.server import EngineServer, ServerSpec
        spec = ServerSpec(name="e", model_dir="m", dtype="float32", token="t", log_path={str(tmp_path / "l.log")!r},
                          command=[sys.executable, "-c",
                                   "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
        s = EngineServer(spec); s.start()
        print("started", flush=True); time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "started"
    pgid_file = tmp_path / "l.pgid"
    for _ in range(100):
        if pgid_file.exists() and len(pids_in_group(int(pgid_file.read_text()))) == 2:
            break
        time.sleep(0.05)
    pgid = int(pgid_file.read_text())
    assert len(pids_in_group(pgid)) == 2
    parent.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the supervisor can save us
    parent.wait()
    for _ in range(100):
        if not pids_in_group(pgid):
            break
        time.sleep(0.05)
    assert pids_in_group(pgid) == []


def test_stop_terminates_the_whole_tree(tmp_path):
    srv = EngineServer(
        _spec(
            tmp_path,
            command=[
                sys.executable,
                "-c",
                "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)",
            ],
        )
    )
    srv.start()
    for _ in range(100):
        if srv._server_pgid() and len(pids_in_group(srv._server_pgid())) == 2:
            break
        time.sleep(0.05)
    pgid = srv._server_pgid()
    assert len(pids_in_group(pgid)) == 2  # the server and its child run: the check below is not vacuous
    t0 = time.monotonic()
    srv.stop()
    assert pids_in_group(pgid) == [] and not srv.alive() and time.monotonic() - t0 < 5


async def test_token_middleware_guards_every_route():
    async def ok(request):
        return JSONResponse({"ok": True})

    app = TokenMiddleware(
        Starlette(routes=[Route("/health", ok), Route("/collective_rpc", ok, methods=["POST"])]), token="tok"
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 401
        assert (await c.post("/collective_rpc", json={"method": "x"})).status_code == 401
        assert (await c.post("/collective_rpc", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await c.get("/health", headers={"Authorization": "Basic tok"})).status_code == 401
        assert (await c.get("/health", headers={"Authorization": "Bearer tok"})).json() == {"ok": True}
        assert (await c.post("/collective_rpc", headers={"Authorization": "Bearer tok"})).status_code == 200


def test_token_middleware_refuses_to_run_without_a_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        TokenMiddleware(lambda *a: None)


def test_server_gets_sigterm_when_the_supervisor_is_sigkilled(tmp_path):
    # Ray SIGKILLs the children of a dead actor (the node agent under --nodes): the supervisor
    # cannot clean up then, so the server itself must hear of it and shut down its own tree
    marker = tmp_path / "got-sigterm"
    child = (f"import signal, sys, time, pathlib\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('1'), sys.exit(0)))\n"
             f"time.sleep(300)")
    srv = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", child]))
    srv.start()
    for _ in range(100):
        if srv._server_pgid() and pids_in_group(srv._server_pgid()):
            break
        time.sleep(0.05)
    pgid = srv._server_pgid()
    time.sleep(0.5)  # the child installs its handler
    srv._proc.send_signal(signal.SIGKILL)
    for _ in range(100):
        if not pids_in_group(pgid):
            break
        time.sleep(0.05)
    assert marker.read_text() == "1" and pids_in_group(pgid) == []
    srv.stop()


def test_watchdog_kills_a_server_that_ignores_sigterm_after_its_supervisor_is_sigkilled(tmp_path):
    # a server whose graceful shutdown hangs (SIGTERM ignored) is SIGKILLed by the supervisor's
    # watchdog once the grace period has passed
    pgid_file = tmp_path / "s.pgid"
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    sup = subprocess.Popen([sys.executable, "-m", "mlrl.rollout.supervisor", "--pgid-file", str(pgid_file),
                            "--parent-pid", str(os.getpid()), "--grace", "1", "--", sys.executable, "-c", child])
    for _ in range(200):
        if pgid_file.exists() and pids_in_group(int(pgid_file.read_text())):
            break
        time.sleep(0.05)
    pgid = int(pgid_file.read_text())
    time.sleep(1.0)  # the child ignores SIGTERM from here on; the watchdog is up
    sup.kill()
    sup.wait()
    time.sleep(0.5)
    assert pids_in_group(pgid), "SIGTERM alone must not have stopped this server"
    for _ in range(100):
        if not pids_in_group(pgid):
            break
        time.sleep(0.05)
    assert pids_in_group(pgid) == []


def test_a_server_that_lost_its_port_starts_again_on_a_fresh_one(tmp_path):
    """free_port() probes a port that vLLM binds seconds later; when another process took it
    meanwhile the server exits with vLLM's bind error, and is started again on a new port."""
    marker = tmp_path / "failed_once"
    child = (
        "import os, sys, http.server\n"
        f"m = {str(marker)!r}\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close(); print('OSError: [Errno 98] Address already in use'); sys.exit(1)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    srv = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", child, "{port}"]))
    try:
        srv.start()
        srv.wait_ready(30)
        assert srv.starts == 2 and marker.exists()
    finally:
        srv.stop()
    # any other start-up failure is not retried
    other = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"]))
    other.start()
    with pytest.raises(EngineStartError, match="exited with code 3"):
        other.wait_ready(30)
    assert other.starts == 1


def test_gpu_engines_keep_vllms_own_process_start(tmp_path, monkeypatch):
    """The fork of the engine core is a CPU measure: on GPU vLLM chooses (fork unless CUDA is already
    initialised) and the CPU-only variables stay unset."""
    import mlrl.rollout.server as server

    monkeypatch.setattr(server, "_on_gpu", lambda: True)
    spec = dataclasses.replace(_spec(tmp_path), engine_tp=1)
    env = server_env(spec)
    assert "MLRL_ENGINE_FORK" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    monkeypatch.setattr(server, "_on_gpu", lambda: False)
    assert server_env(spec)["MLRL_ENGINE_FORK"] == "1"


def test_a_gated_server_waits_for_its_gate_and_an_ungated_one_has_none(tmp_path):
    """start(gated=True) hands the server a gate file (MLRL_ENGINE_GATE) that appears, whole, at
    open_gate(); a server started without it gets no gate. The stand-in server does what
    mlrl.rollout.vllm_main does: wait for the file, then run."""
    child = ("import os, sys, time\n"
             "gate = os.environ.get('MLRL_ENGINE_GATE')\n"
             "print('gate', gate, flush=True)\n"
             "while gate and not os.path.exists(gate): time.sleep(0.02)\n"
             "print('through', open(gate).read().strip() if gate else '-', flush=True)\n")
    srv = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", child]))
    srv.start(gated=True)
    gate = srv.log_path.with_suffix(".gate")
    try:
        for _ in range(100):
            if f"gate {gate}" in srv.log_path.read_text():
                break
            time.sleep(0.05)
        time.sleep(0.3)
        assert srv.alive() and "through" not in srv.log_path.read_text()
        srv.open_gate()
        assert gate.read_text() == "go\n"
        for _ in range(100):
            if srv.exit_code() is not None:
                break
            time.sleep(0.05)
        assert srv.exit_code() == 0 and "through go" in srv.log_path.read_text()
        srv.open_gate()  # once only: a second call is a no-op
        srv.start()
        for _ in range(100):
            if srv.exit_code() is not None:
                break
            time.sleep(0.05)
        assert srv.log_tail(2).splitlines() == ["gate None", "through -"]
    finally:
        srv.stop()


def test_vllm_main_imports_the_server_module_before_it_waits(tmp_path, monkeypatch, capsys):
    from mlrl.rollout import vllm_main

    imported = []
    monkeypatch.setattr(vllm_main.importlib, "import_module", lambda name: imported.append(name))
    gate = tmp_path / "gate"
    opener = threading.Timer(0.3, lambda: gate.write_text("go\n"))
    t0 = time.monotonic()
    opener.start()
    vllm_main._import_then_wait(str(gate))
    assert time.monotonic() - t0 >= 0.3 and gate.exists()
    assert imported == [vllm_main.SERVER_MODULE]
    assert f"{vllm_main.GATE_WAITING} {gate}" in capsys.readouterr().out


def test_a_prestarted_pool_starts_its_servers_gated_and_stops_them_unstarted(tmp_path):
    from mlrl.rollout import EnginePool

    class FakeServer:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self, gated: bool = False) -> None:
            self.calls.append(f"start gated={gated}")

        def stop(self, timeout_s: float = 30.0) -> None:
            self.calls.append("stop")

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    servers: list[FakeServer] = []
    pool = EnginePool(RolloutConfig(num_engines=2), model, run_dir=tmp_path,
                      server_factory=lambda i, spec: servers.append(FakeServer()) or servers[-1])
    pool.prestart()
    with pytest.raises(RuntimeError, match="already"):
        pool.prestart()
    asyncio.run(pool.shutdown())
    assert [s.calls for s in servers] == [["start gated=True", "stop"]] * 2


def _scratch_child(report: Path) -> str:
    """A server stand-in that writes a file where vLLM puts its FileStore (`tempfile.gettempdir()`)
    and reports that folder and its inductor cache folder, then waits."""
    return (f"import json, os, pathlib, tempfile, time\n"
            f"d = tempfile.gettempdir(); pathlib.Path(d, 'vllm_dist_x').write_text('store')\n"
            f"pathlib.Path({str(report)!r}).write_text(json.dumps([d, os.environ.get('TORCHINDUCTOR_CACHE_DIR')]))\n"
            f"time.sleep(300)")


def _wait_report(report: Path) -> tuple[str, str]:
    for _ in range(200):
        if report.exists() and report.read_text():
            break
        time.sleep(0.05)
    scratch, inductor = json.loads(report.read_text())
    return scratch, inductor


@pytest.mark.parametrize("how", ["stop", "supervisor_sigkilled"])
def test_a_servers_temp_folder_is_its_own_and_removed_with_it(tmp_path, monkeypatch, how):
    """vLLM's FileStore file (`<temp>/vllm_dist_<uuid>`) is never removed by vLLM: the server's tree
    gets a temp folder of its own under the launcher's, removed when the server is stopped, or by
    the watchdog when the supervisor was SIGKILLed; torch inductor's cache stays outside it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    report = tmp_path / "report.json"
    srv = EngineServer(_spec(tmp_path, command=[sys.executable, "-c", _scratch_child(report)]))
    srv.start()
    scratch, inductor = _wait_report(report)
    assert Path(scratch).parent == tmp and Path(scratch).name.startswith("mlrl-e")
    assert (Path(scratch) / "vllm_dist_x").exists()
    assert inductor == str(tmp / f"torchinductor_{getpass.getuser()}")
    if how == "stop":
        srv.stop()
    else:
        pgid = srv._server_pgid()
        srv._proc.send_signal(signal.SIGKILL)
        for _ in range(200):
            if not pids_in_group(pgid) and not Path(scratch).exists():
                break
            time.sleep(0.05)
        srv.stop()
    assert list(tmp.iterdir()) == []


def test_a_server_command_that_cannot_start_leaves_no_temp_folder(tmp_path):
    """The temp folder is made before the server starts; a command that cannot be run (no watchdog
    yet) must not leave it behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-m", "mlrl.rollout.supervisor", "--pgid-file", str(tmp_path / "s.pgid"),
                          "--parent-pid", str(os.getpid()), "--", str(tmp_path / "no-such-program")],
                         env=dict(os.environ, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no-such-program" in out.stderr
    assert list(tmp.iterdir()) == []


def test_the_supervisor_process_imports_no_client_pool_or_http_library():
    """Each engine runs two `python -m mlrl.rollout.supervisor` processes (its own and a watchdog);
    they need only the standard library. An eager `mlrl.rollout/__init__` made each import the pool,
    the client, aiohttp and httpx first (~0.6 s of CPU each, next to a starting engine)."""
    probe = ("import runpy, sys; sys.argv = ['supervisor', '--help']\n"
             "try:\n    runpy.run_module('mlrl.rollout.supervisor', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(sorted(m for m in ('mlrl.rollout.pool', 'mlrl.rollout.client', 'mlrl.rollout.server',"
             " 'mlrl.config', 'aiohttp', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    # the package's names still resolve, on first use
    import mlrl.rollout

    assert mlrl.rollout.EnginePool.__module__ == "mlrl.rollout.pool"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = mlrl.rollout.Nope  # pyright: ignore[reportAttributeAccessIssue]
