"""Metrics: JSONL + TensorBoard (+ optional W&B) sinks, step timers and the run plot."""

from mlrl.metrics.plot import plot_run
from mlrl.metrics.sinks import MetricsLogger, read_jsonl
from mlrl.metrics.timer import Timer

__all__ = ["MetricsLogger", "Timer", "plot_run", "read_jsonl"]
