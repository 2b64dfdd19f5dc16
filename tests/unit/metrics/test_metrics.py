import json
from types import SimpleNamespace

import pytest

from mlrl.metrics import MetricsLogger, plot_run, read_jsonl
from mlrl.metrics.timer import ActivityClock, StepTimer, timing_table


def test_jsonl_and_tensorboard_written(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=True)
    for s in range(1, 4):
        log.log(s, {"reward/mean": 0.1 * s, "timing/step": 1.0})
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
    assert [e.value for e in ev.Scalars("timing/step")] == [1.0, 1.0, 1.0]


def test_a_nan_or_inf_metric_reaches_tensorboard_as_a_number(tmp_path):
    """The JSON line writes it as a string (JSON has no NaN); TensorBoard got that string and dropped
    the scalar: a diverged loss vanished from the plots instead of showing."""
    import math

    import torch

    log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"train/loss": float("nan"), "train/grad_norm": torch.tensor(float("inf")), "x": 1.0})
    log.close()
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["train/loss"] == "nan" and rec["train/grad_norm"] == "inf"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tensorboard"))
    ev.Reload()
    assert math.isnan(ev.Scalars("train/loss")[0].value) and ev.Scalars("train/grad_norm")[0].value == math.inf


def test_resume_drops_lines_after_checkpoint_and_torn_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    log.log(4, {"x": 40})
    log.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(p)] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    # the dropped steps are kept aside, not lost
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path / "metrics.dropped.jsonl")] == [(4, 4), (5, 5)]


def test_a_fresh_run_in_a_folder_with_metrics_keeps_the_old_lines_aside(tmp_path, caplog):
    import logging

    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 4)))
    with caplog.at_level(logging.WARNING, logger="mlrl"):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=0).close()
    assert p.read_text() == "" and len(read_jsonl(tmp_path / "metrics.dropped.jsonl")) == 3
    assert "metrics: 3 line(s) of steps after 0" in caplog.text
    # a fresh run with eval.at_start (mlrl.jobs.rl passes -1): an earlier start's step 0 goes aside too
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(0, 2)))
    MetricsLogger(tmp_path, tensorboard=False, resume_step=-1).close()
    assert p.read_text() == "" and len(read_jsonl(tmp_path / "metrics.dropped.jsonl")) == 5


def test_plot_png(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for s in range(1, 5):
        log.log(s, {"reward/mean": s / 4, "timing/step": 2.0, "timing/train": 1.5, "timing/other": 0.5,
                    "mismatch/logprob_gap": 1e-4})
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "run.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_teardown_draws_the_plot_in_a_thread_of_its_own(tmp_path, monkeypatch):
    """close(wait=False), as a run's teardown calls it: the sinks are closed at once, run.png is drawn
    in another thread (the caller stops its engines and ranks meanwhile), and the future it returns
    is done once the file is written, or raises what drawing raised."""
    import threading

    from mlrl.metrics import plot

    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(1, {"reward/mean": 0.5, "timing/step": 1.0})
    drawn_in, release = [], threading.Event()
    real_plot_run = plot.plot_run

    def plot_run_held(records, out):
        drawn_in.append(threading.current_thread())
        assert release.wait(30)
        return real_plot_run(records, out)

    monkeypatch.setattr(plot, "plot_run", plot_run_held)
    drawn = log.close(plot=True, wait=False)
    assert drawn is not None and not drawn.done()  # close returned while the drawing waits
    assert not (tmp_path / "run.png").exists()
    release.set()
    assert drawn.result(timeout=60) == tmp_path / "run.png"
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn_in and drawn_in[0] is not threading.current_thread()

    def broken(records, out):
        raise ValueError("no figure")

    monkeypatch.setattr(plot, "plot_run", broken)
    failed = MetricsLogger(tmp_path / "b", tensorboard=False)
    failed.log(1, {"reward/mean": 0.5})
    with pytest.raises(ValueError, match="no figure"):
        failed.close(plot=True, wait=False).result(timeout=60)
    # nothing to draw: no thread, no future
    assert MetricsLogger(tmp_path / "c", tensorboard=False).close(plot=True, wait=False) is None
    assert MetricsLogger(tmp_path / "d", tensorboard=False).close(plot=False, wait=False) is None


def test_the_plots_phase_bars_add_up_to_the_step_time_colocated_phases_included(tmp_path, monkeypatch):
    """timing/other is the step time less every timer phase (mlrl.metrics.timer.PHASES): the stacked
    bars must draw each of them, or a colocated run's bars fall short by sleep + wake + offload + reload."""
    import matplotlib.axes

    drawn = {}
    real_bar = matplotlib.axes.Axes.bar

    def bar(self, xs, ys, *a, label=None, **kw):
        drawn[label] = list(ys)
        return real_bar(self, xs, ys, *a, label=label, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    rec = {"step": 1, "timing/step": 10.0, "timing/rollout": 3.0, "timing/train": 2.0, "timing/sleep": 1.0,
           "timing/wake": 1.5, "timing/offload": 0.5, "timing/reload": 1.0, "timing/other": 1.0}
    plot_run([rec], tmp_path / "run.png")
    assert {"sleep", "wake", "offload", "reload"} <= set(drawn)
    assert sum(ys[0] for ys in drawn.values()) == pytest.approx(10.0)


class FakeClock:
    """perf_counter() that only moves when told to."""

    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    import mlrl.metrics.timer as timer_mod

    c = FakeClock(100.0)
    monkeypatch.setattr(timer_mod, "time", SimpleNamespace(perf_counter=c))
    return c


def test_step_phases_sum_to_the_wall_time(clock):

    act = ActivityClock()
    t = StepTimer(start=99.0, clock=act)        # the previous step ended 1 s before this one's first phase
    t.add("checkpoint", 0.75)                    # ... spent saving the previous step's checkpoint
    with t("rollout"):
        with act.busy("generate"):               # two overlapping requests: 100 -> 103 busy
            clock.t = 101.0
            with act.busy("generate"):
                clock.t = 103.0
        with act.busy("reward"):                 # 103 -> 104 reward alone, 104 -> 104.5 beside generation
            clock.t = 104.0
            with act.busy("generate"):
                clock.t = 104.5
        clock.t = 105.0                          # the runner's own work
    with t("train"):
        clock.t = 107.0
    with t("sync"):
        clock.t = 107.5
    with t("train"):                             # a phase entered twice adds up
        clock.t = 108.0
    clock.t = 108.25
    m = t.finish(details={"train/forward_backward": 1.5, "sync/transfer": 0.25})
    assert m["timing/step"] == 9.25
    # generation busy 100-103 and 104-104.5; reward alone 103-104 (its overlap with generation is generation's)
    assert m["timing/rollout"] == 3.5 and m["timing/reward"] == 1.0 and m["timing/rollout/phase"] == 5.0
    assert m["timing/train"] == 2.5 and m["timing/sync"] == 0.5 and m["timing/checkpoint"] == 0.75
    assert m["timing/train/forward_backward"] == 1.5 and m["timing/sync/transfer"] == 0.25
    top = [k for k in m if k.count("/") == 1 and k not in ("timing/step", "timing/overlap")]
    assert sum(m[k] for k in top) == pytest.approx(m["timing/step"])      # other = the rest, exactly
    assert m["timing/other"] == pytest.approx(9.25 - 3.5 - 1.0 - 2.5 - 0.5 - 0.75)


def test_async_overlap_counts_generation_during_trainer_work(clock):

    act = ActivityClock()
    t = StepTimer(clock=act)                     # starts at 100
    with act.busy("generate"):                   # background generation 100 -> 106
        with t("rollout"):                       # waiting for samples 100 -> 101
            clock.t = 101.0
        with t("train"):                         # training 101 -> 104, generation busy throughout
            clock.t = 104.0
        clock.t = 106.0
    m = t.finish(overlapped_rollout=True)
    assert m["timing/rollout"] == 1.0 and m["timing/overlap"] == 3.0 and "timing/reward" not in m
    assert m["timing/other"] == pytest.approx(6.0 - 1.0 - 3.0)


def test_timing_table_shows_means_and_shares():

    hist = [{"timing/step": 9.0, "timing/train": 6.0, "timing/other": 3.0},
            {"timing/step": 2.0, "timing/train": 1.5, "timing/other": 0.5},
            {"timing/step": 4.0, "timing/train": 2.5, "timing/other": 1.5}]
    table = timing_table(hist).splitlines()
    row = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert row["timing/train"] == ["6.000", "2.000", "66.7%"] and row["timing/step"] == ["9.000", "3.000"]
    assert table[-1].startswith("timing/step")
    assert timing_table([{"reward/mean": 1.0}]) == ""


def test_fresh_run_in_a_used_folder_starts_a_clean_curve(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 4)))
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=0)
    log.log(1, {"x": 10})
    log.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(p)] == [(1, 10)]
