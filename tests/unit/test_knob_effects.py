"""Config fields whose effect no run-level test shows, each run with two values and the outcome
compared: the checkpoint / export schedule, the metric sinks, the console (log level, progress
bar), the engines' command line and environment, and activation recomputation reaching
megatron-core's TransformerConfig."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.config import load_config
from mlrl.config.schema import CheckpointConfig, RolloutConfig
from mlrl.config.validate import resolve_layout

ROOT = Path(__file__).resolve().parents[2]


def _due(total: int = 6, **fields) -> list[tuple[int, bool, bool]]:
    """(step, save, export) for every step where something is due."""
    from mlrl.checkpoint.schedule import saves_due

    c = CheckpointConfig(**fields)
    return [(s, *saves_due(c, s, total)) for s in range(1, total + 1) if any(saves_due(c, s, total))]


def test_the_save_and_export_schedule_follows_each_field():
    assert _due() == [(6, True, True)]                                        # defaults: both at the end
    assert _due(save_every=2) == [(2, True, False), (4, True, False), (6, True, True)]
    assert _due(hf_export_every=3) == [(3, False, True), (6, True, True)]
    assert _due(save_at_end=False) == [(6, False, True)]
    assert _due(hf_export_at_end=False) == [(6, True, False)]
    assert _due(save_at_end=False, hf_export_at_end=False) == []
    assert _due(save_every=4, save_at_end=False, hf_export_at_end=False) == [(4, True, False)]


@pytest.mark.parametrize("jsonl,tensorboard,plot", [(True, True, True), (True, False, False), (False, True, False),
                                                     (False, False, True)])  # the plot without metrics.jsonl: memory
def test_each_metric_sink_writes_only_when_on(tmp_path, jsonl, tensorboard, plot):
    from mlrl.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, jsonl=jsonl, tensorboard=tensorboard)
    for s in (1, 2):
        log.log(s, {"reward/mean": s / 2, "timing/step": 1.0})
    log.close(plot=plot)
    assert (tmp_path / "metrics.jsonl").exists() is jsonl
    assert (tmp_path / "tensorboard").exists() is tensorboard
    assert any(tmp_path.glob("*.png")) is plot


def test_the_progress_bar_is_drawn_only_when_on(capsys):
    from mlrl.metrics.console import progress_bar

    assert progress_bar(False, total=4, initial=0, desc="SFT steps") is None
    bar = progress_bar(True, total=4, initial=1, desc="SFT steps")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "SFT steps" in err and "2/4" in err


@pytest.mark.parametrize("level,shown", [("INFO", True), ("WARNING", False)])
def test_the_log_level_filters_the_jobs_lines(level, shown):
    code = ("import logging\nfrom mlrl.metrics.console import configure_logging\n"
            f"configure_logging({level!r})\nlogging.getLogger('mlrl').info('an info line')\n"
            "logging.getLogger('mlrl').warning('a warning line')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stderr
    assert "a warning line" in err and ("an info line" in err) is shown


def test_the_engines_command_line_follows_host_eager_and_kv_cache(tmp_path):
    from mlrl.rollout.server import ServerSpec, server_command, server_env

    def spec(**kw):
        return ServerSpec.from_config(RolloutConfig(**kw), "e0", "/models/m", "float32", "t", omp_threads=1)

    default, other = spec(), spec(host="0.0.0.0", enforce_eager=False, cpu_kv_cache_gb=3.0)
    a, b = server_command(default, 8000), server_command(other, 8000)
    assert a[a.index("--host") + 1] == "127.0.0.1" and b[b.index("--host") + 1] == "0.0.0.0"
    assert "--enforce-eager" in a and "--enforce-eager" not in b
    assert server_env(default)["VLLM_CPU_KVCACHE_SPACE"] == "1" and server_env(other)["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_recompute_reaches_megatrons_transformer_config():
    from mlrl.bridge import spec_for
    from mlrl.modelzoo import hf_config_dict
    from mlrl.trainer.rank import model as model_mod

    cfg = load_config(ROOT / "launch" / "cpu_default.yaml")
    _, arch = spec_for(hf_config_dict("builtin:tiny-llama"))

    def fields(recompute: str) -> dict:
        t = dataclasses.replace(cfg.trainer, recompute=recompute)
        f = model_mod.layout_fields(arch, cfg.model, cfg.parallel, t, resolve_layout(cfg))
        return {k: f.get(k) for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")}

    assert fields("none") == {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    assert fields("selective") == {"recompute_granularity": "selective", "recompute_method": None,
                                   "recompute_num_layers": None}
    assert fields("full") == {"recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1}


def test_the_critics_body_comes_from_critic_hf_dir_when_given(tmp_path):
    from mlrl.config.schema import CriticConfig
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.trainer.rank.service import critic_body_dir

    policy = resolve_model_dir("builtin:tiny-llama")
    assert critic_body_dir(CriticConfig(), policy) == policy
    assert critic_body_dir(CriticConfig(hf_dir="builtin:tiny-qwen3"), policy) == resolve_model_dir("builtin:tiny-qwen3")
