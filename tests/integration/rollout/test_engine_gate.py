"""Engines that start while the run checks its inputs (EnginePool.prestart, the gate of
mlrl.rollout.vllm_main): a real vLLM CPU server imports vLLM, then waits, serving nothing, until
the pool starts it; a run whose input check fails stops its gated engines and reports the input."""

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest
from helpers.launching import ROOT

from mlrl.config.schema import RolloutConfig
from mlrl.rollout import EnginePool
from mlrl.rollout.supervisor import pids_in_group
from mlrl.rollout.vllm_main import GATE_WAITING
from mlrl.types import GenerationHyperparameters, ModelRequest, StopReason

pytestmark = pytest.mark.timeout(600)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_prestarted_engine_imports_vllm_then_waits_for_start(tmp_path, vllm_tiny_llama):
    pool = EnginePool(RolloutConfig(num_engines=1, max_model_len=256, cpu_kv_cache_gb=1.0), vllm_tiny_llama,
                      run_dir=tmp_path)
    server = pool.engines[0].server

    async def scenario() -> None:
        pool.prestart()
        try:
            deadline = time.monotonic() + 300
            while GATE_WAITING not in server.log_path.read_text(errors="replace"):
                assert server.alive(), server.log_tail()
                assert time.monotonic() < deadline, server.log_tail()
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            # imported and waiting: alive, no port bound, no engine built
            assert server.alive() and server.port is not None
            assert not _listening(server.port)
            assert "Initializing a V1 LLM engine" not in server.log_path.read_text(errors="replace")
            await pool.start()
            resp = await pool.agenerate(ModelRequest(input_ids=[1, 5, 6, 7],
                                                     gconfig=GenerationHyperparameters(max_new_tokens=3,
                                                                                       min_new_tokens=3)))
            assert resp.stop_reason == StopReason.LENGTH and len(resp.output_tokens) == 3, resp
        finally:
            pgid = server._server_pgid()
            await pool.shutdown()
        assert pgid is not None and pids_in_group(pgid) == []

    asyncio.run(scenario())


def test_a_failed_input_check_stops_the_gated_engines_and_names_the_row(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question_text": "copy 3"}) + "\n")
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "mlrl.launch", f"data.train={data}", f"logging.run_dir={run}",
         "logging.progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert f"data error: data.train: {data}:1: the row has no 'messages'" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    # the engine had been started (gated) and is gone, its whole process group with it
    log = (run / "engines" / "engine-0.log").read_text(errors="replace")
    assert "starting engine-0" in log and "Starting vLLM server" not in log, log[-2000:]
    pgid = int((run / "engines" / "engine-0.pgid").read_text())
    assert pids_in_group(pgid) == []
