"""The end-of-run PNG: reward, KL, train/rollout logprob gap, and where each step's time went
(the timing/* phases stacked, see mlrl.metrics.timer) against the step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlrl.metrics.sinks import read_jsonl
from mlrl.metrics.timer import PHASES

PANELS = [
    ("reward/mean", "mean reward"),
    ("train/kl", "KL to reference"),
    ("train/mismatch/logprob_gap", "|train - rollout| logprob"),
    ("timing/step", "step time (s), by phase"),
]
PHASE_KEYS = [f"timing/{p}" for p in (*PHASES, "other")]  # colocated runs' sleep / wake / offload / reload too


def plot_run(metrics: str | Path | Sequence[dict[str, Any]], out_png: str | Path) -> Path:
    """run.png from a metrics.jsonl file or its records (one dict per step). matplotlib's object API
    (no pyplot: no global figure registry or backend choice), so it may draw in any thread: a run's
    teardown draws it in one of its own (mlrl.metrics.sinks.MetricsLogger.close)."""
    from matplotlib.figure import Figure

    recs = read_jsonl(metrics) if isinstance(metrics, (str, Path)) else list(metrics)
    fig = Figure(figsize=(10, 7))
    axes = fig.subplots(2, 2)
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        if key == "timing/step" and pts:
            steps = [r for r in recs if isinstance(r.get(key), (int, float))]
            xs = [r["step"] for r in steps]
            bottom = [0.0] * len(steps)
            for phase in PHASE_KEYS:
                ys = [max(float(r.get(phase, 0.0)), 0.0) for r in steps]
                if any(ys):
                    ax.bar(xs, ys, bottom=bottom, label=phase.split("/", 1)[1], width=0.8)
                    bottom = [b + y for b, y in zip(bottom, ys)]
            ax.legend(fontsize=7, ncol=2)
        elif pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=90)
    return out
