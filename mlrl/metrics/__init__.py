"""Metrics: JSONL + TensorBoard (+ optional W&B) sinks, step timers and the run plot."""

from mlrl.metrics.plot import plot_run
from mlrl.metrics.sinks import MetricsLogger, read_jsonl
from mlrl.metrics.timer import ACTIVITY, StepTimer

__all__ = ["ACTIVITY", "MetricsLogger", "StepTimer", "plot_run", "read_jsonl"]
