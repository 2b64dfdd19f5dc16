import json
from types import SimpleNamespace

import pytest

from mlrl.metrics import MetricsLogger, Timer, plot_run, read_jsonl


def test_jsonl_and_tensorboard_written(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=True)
    for s in range(1, 4):
        log.log(s, {"reward/mean": 0.1 * s, "time/step_s": 1.0})
    log.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert abs(recs[2]["reward/mean"] - 0.3) < 1e-12
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tensorboard"))
    ev.Reload()
    scalars = [(e.step, e.value) for e in ev.Scalars("reward/mean")]
    assert [s for s, _ in scalars] == [1, 2, 3]
    assert [v for _, v in scalars] == [pytest.approx(0.1 * s, abs=1e-6) for s in (1, 2, 3)]  # float32 in the event file
    assert [e.value for e in ev.Scalars("time/step_s")] == [1.0, 1.0, 1.0]


def test_resume_drops_lines_after_checkpoint_and_torn_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    log.log(4, {"x": 40})
    log.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(p)] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_plot_png(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for s in range(1, 5):
        log.log(s, {"reward/mean": s / 4, "time/step_s": 2.0, "mismatch/logprob_gap": 1e-4})
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "run.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timer(monkeypatch):
    import mlrl.metrics.timer as timer_mod

    clock = iter([10.0, 10.25, 20.0, 20.5, 30.0, 31.0])   # perf_counter() at each enter / exit
    monkeypatch.setattr(timer_mod, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    t = Timer()
    with t("a"):
        pass
    with t("b"):
        pass
    with t("a"):                                           # the same name again within a step adds up
        pass
    assert t.pop() == {"time/a_s": 0.25 + 1.0, "time/b_s": 0.5}
    assert t.pop() == {}


def test_fresh_run_in_a_used_folder_starts_a_clean_curve(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 4)))
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=0)
    log.log(1, {"x": 10})
    log.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(p)] == [(1, 10)]
