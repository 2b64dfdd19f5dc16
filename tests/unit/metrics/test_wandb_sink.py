"""The Weights & Biases sink, offline (no network, no account): the run's transaction log appears
under <run_dir>/wandb/offline-run-*/ and holds what was logged; a missing wandb is a clear error.

wandb is the `wandb` extra (`pip install mlrl[wandb]`), installed by scripts/setup_env.sh, so
this runs in CI rather than skipping."""

import json
import struct
import sys
import time

import psutil
import pytest

from mlrl.metrics import MetricsLogger, read_jsonl


def _read_wandb_log(path):
    """Records of a run-*.wandb file: the 7-byte W&B header (':W&B', magic, version), then
    LevelDB-log framing (32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST)
    around wandb's `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:            # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):                     # FULL, LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
        elif kind == 0 and n == 0:             # zero padding
            buf = b""
    return records


def _items(items):
    """{key: value} of history / summary / config items (a key may come as `nested_key` parts)."""
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


def _wandb_children():
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    import wandb  # no importorskip: a missing extra must fail here, not skip

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                 "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                 "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(k, v)
    for k in ("WANDB_RUN_ID", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(k, raising=False)
    yield wandb
    if wandb.run is not None:                  # a failed test must not leave its run open
        wandb.finish()
    wandb.teardown()                           # stops the wandb-core service process
    deadline = time.monotonic() + 15           # (it may take a moment to exit on a loaded machine)
    while _wandb_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _wandb_children(), "wandb left a background process behind"


def test_wandb_offline_run_records_the_logged_steps(tmp_path, wandb_offline):
    log = MetricsLogger(tmp_path, tensorboard=False, wandb_project="mlrl-unit", config={"lr": 1e-3, "algo": "grpo"})
    try:
        for s in range(1, 4):
            log.log(s, {"reward/mean": 0.25 * s, "timing/step": 1.5})
    finally:
        log.close()
    assert wandb_offline.run is None           # close() finished the run

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log_file,) = runs[0].glob("run-*.wandb")
    # wandb's own service process writes the file: on a loaded machine it may still be writing when
    # finish() returns (a run's process exit waits for it, at wandb's teardown)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            kinds = [r.WhichOneof("record_type") for r in _read_wandb_log(log_file)]
        except Exception:  # (a record half-written)
            kinds = []
        if kinds and kinds[-1] == "exit":
            break
        time.sleep(0.2)
    records = _read_wandb_log(log_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header" and kinds[-1] == "exit" and records[-1].exit.exit_code == 0

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "mlrl-unit" and log_file.name == f"run-{run.run_id}.wandb"
    config = _items(run.config.update)
    assert config["lr"] == 1e-3 and config["algo"] == "grpo"

    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["reward/mean"] for h in history] == [0.25, 0.5, 0.75]
    assert all(h["timing/step"] == 1.5 for h in history)
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["reward/mean"] == 0.75 and summary["_step"] == 3
    # the JSONL sink ran beside it
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25, 0.5, 0.75]


def test_missing_wandb_is_a_clear_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` now raises ImportError
    run_dir = tmp_path / "run"
    with pytest.raises(ImportError, match=r"pip install mlrl\[wandb\]"):
        MetricsLogger(run_dir, tensorboard=False, wandb_project="p")
    assert not run_dir.exists()                        # raised before touching the run folder
    MetricsLogger(run_dir, tensorboard=False).close()  # without wandb_project wandb is not needed


@pytest.mark.parametrize("wandb_step,warned", [(13, True), (6, False)])
def test_continuing_a_wandb_run_past_the_resumed_step_says_what_wandb_drops(tmp_path, monkeypatch, caplog,
                                                                             wandb_step, warned):
    """W&B ignores steps below the run's current one (its offline mode cannot resume a run, so a
    stand-in reports the step W&B would): resuming step 5 into a W&B run that reached step 12, steps
    6-12 never reach W&B."""
    from types import SimpleNamespace

    from mlrl.metrics import sinks

    logged = []
    run = SimpleNamespace(step=wandb_step, id="abc", log=lambda rec, step: logged.append(step))
    monkeypatch.setattr(sinks, "_import_wandb", lambda: SimpleNamespace(init=lambda **kw: run))
    with caplog.at_level("WARNING"):
        log = MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", resume_step=5)
    log.log(6, {"x": 1.0})
    assert logged == [6]
    assert ("W&B run abc already holds steps up to 12; W&B ignores steps below that, so steps 6-12" in caplog.text) \
        == warned
