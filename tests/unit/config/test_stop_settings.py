"""rollout.sampling.stop / stop_token_ids: refused by field when malformed (validation) or naming a
token the model's tokenizer lacks (the jobs' checks, before any engine works), and carried into
every request's sampling parameters (mlrl.workflow.gconfig_from_sampling -> vLLM's SamplingParams;
tests/integration/rollout/test_vllm_pool.py shows a real engine stopping on them)."""

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.config.schema import SamplingConfig
from mlrl.jobs.model_folder import check_stop_tokens
from mlrl.rollout.client import sampling_params
from mlrl.workflow import gconfig_from_sampling, load_hf_tokenizer


def _rl(*overrides):
    return load_config(None, ["model.hf_dir=builtin:tiny-llama", "data.max_prompt_tokens=64", *overrides])


@pytest.mark.parametrize("override,match", [
    ("rollout.sampling.stop=['</answer>', '']", r"^rollout.sampling.stop\[1\]='': expected a non-empty string"),
    ("rollout.sampling.stop_token_ids=[2, -1]", r"^rollout.sampling.stop_token_ids\[1\]=-1: expected a token id"),
])
def test_malformed_stop_settings_are_refused_by_field(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(_rl(override), has_cuda=False)


def test_stop_settings_reach_each_requests_sampling_params():
    cfg = _rl("rollout.sampling.stop=['</answer>']", "rollout.sampling.stop_token_ids=[2, 7]")
    validate(cfg, has_cuda=False)
    sp = sampling_params(gconfig_from_sampling(cfg.rollout.sampling))
    assert sp["stop"] == ["</answer>"] and sp["stop_token_ids"] == [2, 7] and sp["detokenize"] is True
    plain = sampling_params(gconfig_from_sampling(SamplingConfig()))
    assert "stop" not in plain and "stop_token_ids" not in plain and plain["detokenize"] is False


def test_a_stop_token_id_past_the_tokenizer_is_refused():
    tok = load_hf_tokenizer("builtin:tiny-llama")
    check_stop_tokens(SamplingConfig(stop_token_ids=[len(tok) - 1]), tok)
    with pytest.raises(ConfigError, match=rf"^rollout.sampling.stop_token_ids\[1\]={len(tok)}: the tokenizer of "
                                          rf"model.hf_dir has {len(tok)} tokens"):
        check_stop_tokens(SamplingConfig(stop_token_ids=[0, len(tok)]), tok)


@pytest.mark.parametrize("recipe", ["launch/cpu_default.yaml", "launch/eval_cpu.yaml"])
def test_a_run_with_an_unknown_stop_token_stops_before_any_engine_or_rank_works(tmp_path, recipe):
    from helpers.launching import launch_refused

    out = launch_refused("--config", recipe, "model.hf_dir=builtin:tiny-llama",
                         "rollout.sampling.stop_token_ids=[999999]",
                         f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rollout.sampling.stop_token_ids[0]=999999: the tokenizer of model.hf_dir has" in out.stderr
    assert not list((tmp_path / "run").glob("trainer*")) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bench_vs_trl_refuses_stop_settings_trl_would_not_apply():
    from helpers.tools import load_tool

    bench = load_tool("bench_vs_trl")
    bench.check_mappable(_rl())
    with pytest.raises(SystemExit, match=r"rollout.sampling.stop / stop_token_ids"):
        bench.check_mappable(_rl("rollout.sampling.stop_token_ids=[2]"))
