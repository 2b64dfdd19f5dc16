"""Runs `trainer_worker.py` under torchrun (gloo, CPU) and returns each rank's JSON results.

One launch costs ~10-17 s (megatron import ~5 s), so each test module groups several checks
per launch (module-scoped fixtures). The process group is killed on timeout, and a failed
launch raises with the tail of its output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mlrl.procs import kill_tree, torchrun_command

WORKER = Path(__file__).with_name("trainer_worker.py")
REPO = Path(__file__).resolve().parents[3]


def run_torchrun(script: Path, args: list[str], nproc: int, *, timeout: float = 420.0) -> tuple[list[dict], str]:
    """Launch, retrying once when the rendezvous port was taken between picking and binding it."""
    try:
        return _run_torchrun(script, args, nproc, timeout=timeout)
    except _PortTaken:
        return _run_torchrun(script, args, nproc, timeout=timeout)


class _PortTaken(AssertionError):
    pass


def _run_torchrun(script: Path, args: list[str], nproc: int, *, timeout: float) -> tuple[list[dict], str]:
    out = Path(tempfile.mkdtemp(prefix="mlrl-trainer-"))  # the ranks' result files; removed once read
    try:
        return _run_ranks(script, args, nproc, timeout, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _run_ranks(script: Path, args: list[str], nproc: int, timeout: float, out: Path) -> tuple[list[dict], str]:
    cmd = torchrun_command(nproc, str(script), "--out", str(out), *args)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)),
               PYTHONPATH=os.pathsep.join([str(REPO), str(script.parent), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun's workers run in sessions of their own and hold the pipe
        log, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out after {timeout:.0f} s: {' '.join(cmd)}\n{log[-6000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    results = []
    for r in range(nproc):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {})
    if proc.returncode != 0:
        errors = "\n".join(r.get("error", "") for r in results)
        if not errors and ("EADDRINUSE" in log or "address already in use" in log.lower()):
            raise _PortTaken(log[-2000:])
        raise AssertionError(f"torchrun exited {proc.returncode}: {' '.join(cmd)}\n{errors or log[-6000:]}")
    return results, log


def run_worker(nproc: int, *, checks: list[str], models: list[str], tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
               trainer_opts: dict | None = None, timeout: float = 420.0) -> list[dict]:
    """Each rank's results {"<model>/<check>": {...}, "ranks": {...}}; see trainer_worker.py for
    the `model+sp` and `check@model` syntax."""
    args = [
        "--models",
        ",".join(models),
        "--checks",
        ",".join(checks),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--ep",
        str(ep),
        "--cp",
        str(cp),
        "--trainer-opts",
        ",".join(f"{k}={v}" for k, v in (trainer_opts or {}).items()),
    ]
    return run_torchrun(WORKER, args, nproc, timeout=timeout)[0]


# ---- assertions shared by the layout test modules (results of every rank) ----------------------
def assert_parity(ranks: list[dict], model: str, tol: float = 1e-5) -> None:
    for r in ranks:
        p = r[f"{model}/parity"]
        assert p["logits"] <= tol, p
        assert max(p["logprob"], p["entropy"], p["logprob_t07"], p["entropy_t07"]) <= tol, p
        assert p["first_token_zero"], p


def assert_rope(ranks: list[dict], model: str, tol: float = 1e-5) -> None:
    """RoPE scaling at long positions: Megatron equals HF, and HF without the scaling is far off
    (so the parity is a test of the scaling, not of positions where it changes nothing)."""
    for r in ranks:
        p = r[f"{model}/rope"]
        assert p["positions"] > 150 and p["logits"] <= tol, p
        assert p["unscaled_gap"] > 100 * max(p["logits"], 1e-7), p


def assert_export(ranks: list[dict], model: str) -> None:
    """Bit-exact, every HF tensor exactly once over the stage senders, nothing from the others."""
    names: list[str] = []
    for r in ranks:
        e = r[f"{model}/export"]
        assert e["mismatched"] == [], e["mismatched"]
        if e["sender"]:
            names += e["names"]
        else:
            assert e["buckets"] == 0 and e["names"] == []
    assert sorted(names) == ranks[0][f"{model}/export"]["hf_names"]


def assert_grads(ranks: list[dict], model: str, tol: float = 1e-6) -> None:
    names: list[str] = []
    for r in ranks:
        g = r[f"{model}/grads"]
        for n in (1, 4):
            assert g[f"loss_err_{n}"] <= tol and g[f"grad_err_{n}"] <= tol, g
        assert g["grad_max_1"] > 1e-3  # gradients are not trivially zero
        assert g["split_loss_diff"] <= tol and g["split_grad_diff"] <= tol, g
        assert g["tokens_1"] == g["tokens_4"] > 0
        # _max / _min metrics are the step's, whatever the split (they were summed over micro-batches and DP ranks)
        (lo1, hi1), (lo4, hi4) = g["lp_range_1"], g["lp_range_4"]
        assert lo1 < hi1 < 0 and abs(lo1 - lo4) <= tol and abs(hi1 - hi4) <= tol, g
        assert g["names_1"] == g["names_4"]
        names += g["names_1"]
    # grad_err is a max over the exported gradients: together the ranks exported (and so compared)
    # the gradient of every HF parameter
    assert set(names) == set(ranks[0][f"{model}/grads"]["ref_names"])


def assert_adam(ranks: list[dict], model: str) -> None:
    """Parameters after three steps (lr 1e-3, warm-up, weight decay, clipping active, adam_eps
    1e-5 so that fp32 gradient noise cannot be amplified by Adam's per-element normalisation)."""
    names: list[str] = []
    for r in ranks:
        a = r[f"{model}/adam"]
        assert a["lrs"] == [5e-4, 1e-3, 1e-3]  # warm-up 2: step k uses lr * k / 2
        if a["names"]:  # the ranks that export weights (stage senders) compare them
            assert a["moved"] > 1e-3
            assert a["param_err"] <= 1e-6, a
            assert a["param_err_mean"] <= 1e-8, a
            names += a["names"]
    # together those ranks compared every parameter of the model (not none of them)
    assert set(names) == set(ranks[0][f"{model}/adam"]["ref_names"])


def assert_shared_prefix(ranks: list[dict], model: str, tol: float = 1e-5) -> None:
    """trainer.shared_prefix_packing gives the per-sample packing's logprobs, entropy, loss and
    gradients to float32 rounding, from fewer tokens."""
    for r in ranks:
        res = r[f"{model}/shared_prefix"]
        assert res["tokens_True"] < 0.75 * res["tokens_False"], res  # 78 vs 112 tokens: each prompt once per unit
        assert res["logprob_max"] > 1.0, res  # real logprobs were compared, not zeros
        assert res["logprob_diff"] <= tol and res["entropy_diff"] <= tol, res
        assert abs(res["loss_True"] - res["loss_False"]) <= tol, res
        assert res["grad_names_equal"], res
        assert res["grad_diff"] <= tol * max(res["grad_max"], 1e-3), res
    assert max(r[f"{model}/shared_prefix"]["grad_max"] for r in ranks) > 1e-3  # real gradients were compared
