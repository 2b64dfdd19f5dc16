"""An evaluation run (`evaluate:` section, mlrl.jobs.evaluate): what validation accepts and refuses
before any process starts, where its engines go on GPUs, and how answers are written."""

import asyncio
import io
import json
from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.jobs import job_name
from mlrl.jobs.evaluate_run import answer
from mlrl.jobs.placement import local_placement
from mlrl.types import EpisodeStatus, Sample, SampleStatus
from mlrl.workflow.answers import AnswerWriter, answer_record
from mlrl.workflow.runner import EpisodeResult, GroupResult

ROOT = Path(__file__).resolve().parents[3]
BASE = ["model.hf_dir=builtin:tiny-llama"]


def _cfg(*overrides):
    return load_config(ROOT / "launch" / "eval_cpu.yaml", [*BASE, *overrides])


def _check(*overrides, **kw):
    return validate(_cfg(*overrides), **kw)


def test_the_recipe_is_an_evaluation_with_no_trainer():
    cfg = _cfg()
    assert job_name(cfg) == "evaluate"
    layout = validate(cfg, has_cuda=False)
    assert (layout.trainer_devices, layout.dp, layout.rollout_devices) == (0, 0, 0)
    # trainer.seed is read (it seeds a synthetic data.eval); data.eval_every=0 is no error here
    validate(_cfg("trainer.seed=7"), has_cuda=False)


def test_any_served_model_is_evaluated_without_the_trainers_layout_rules():
    """A MoE model (whose expert layout the trainer would have to fit) and a model the built-in
    bridge does not know are served by the engines alone; a classifier is still refused."""
    validate(_cfg("model.hf_dir=builtin:tiny-qwen3-moe"), has_cuda=False)
    with pytest.raises(ConfigError, match="exceeds the trainer ranks"):  # (the rule the evaluation skips)
        validate(load_config(ROOT / "launch" / "cpu_default.yaml", ["model.hf_dir=builtin:tiny-qwen3-moe",
                                                                     "parallel.ep=2"]), has_cuda=False)
    from mlrl.config.validate_model import check_model

    layout = validate(_cfg(), has_cuda=False)
    nested = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": {}}
    check_model(_cfg(), nested, layout, trainer=False)  # (a trainer would refuse it: no top-level heads)
    with pytest.raises(ConfigError, match="lacks num_attention_heads"):
        check_model(_cfg(), nested, layout)
    classifier = {"architectures": ["LlamaForSequenceClassification"], "num_attention_heads": 4,
                  "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match="cannot be the policy, the evaluated model"):
        check_model(_cfg(), classifier, layout, trainer=False)


@pytest.mark.parametrize("override,needle", [
    ("data.eval=null", "data.eval: an evaluation"),
    ("evaluate.max_prompts=-1", "evaluate.max_prompts=-1: expected >= 0"),
    ("evaluate.output=' '", "evaluate.output is empty"),
    ("sft={}", "evaluate and sft:"),
    ("rm={}", "evaluate and rm:"),
    ("critic={}", "critic: an evaluation"),
    ("model.lora.rank=8", "serves a whole model; evaluate a LoRA run's merged export"),
    ("model.init_from=runs/x/checkpoints/step_000001", "tools/convert_checkpoint.py mcore-to-hf"),
    ("model.bridge=builtin", "model.bridge=builtin: the trainer's"),
    ("cluster.placement=colocated", "cluster.placement=colocated: an evaluation"),
    ("cluster.trainer_devices=1", "cluster.trainer_devices=1: the trainer's devices"),
    ("trainer.lr=1e-3", "trainer.lr: a training setting"),
    ("trainer.samples_per_prompt=3", "trainer.samples_per_prompt: a training setting"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_coef: a training setting"),
    ("checkpoint.save_every=5", "checkpoint.save_every: a training setting"),
    ("parallel.tp=2", "parallel.tp: a training setting"),
    ("weight_sync.transport=disk", "weight_sync.transport: a training setting"),
    ("rollout.staleness=1", "rollout.staleness=1: asynchronous training"),
    ("data.train=synthetic:add", "data.train='synthetic:add'"),
    ("data.eval_every=5", "data.eval_every=5"),
    ("data.shuffle=false", "data.shuffle=False"),
    ("logging.plot=false", "logging.plot=False: the training curves' PNG"),
    ("workflow.max_failure_steps=2", "workflow.max_failure_steps=2"),
    ("eval.save_answers=true", "eval.save_answers=True: a training run's held-out answers"),
    ("eval.at_start=true", "eval.at_start=True: a training run's evaluation of its starting policy"),
    ("rollout.sampling.temperature=0", "temperature=0 (greedy) with eval.samples_per_prompt=8"),
])
def test_what_an_evaluation_does_not_use_is_refused_by_name(override, needle):
    with pytest.raises(ConfigError) as e:
        _check(override, has_cuda=False)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("field", ["save_answers", "at_start"])
def test_a_training_runs_eval_setting_needs_a_held_out_set_and_an_rl_run(field):
    rl = ROOT / "launch" / "cpu_default.yaml"
    with pytest.raises(ConfigError, match=rf"^eval.{field}=True has no effect without data.eval"):
        validate(load_config(rl, [f"eval.{field}=true"]), has_cuda=False)
    validate(load_config(rl, [f"eval.{field}=true", "data.eval=synthetic:copy_digit", "data.eval_every=5"]),
             has_cuda=False)
    with pytest.raises(ConfigError, match=rf"^eval.{field}: an RL setting; an SFT run"):
        validate(load_config(ROOT / "launch" / "sft_cpu.yaml", [f"eval.{field}=true"]), has_cuda=False)


def test_greedy_is_refused_for_groups_in_training_too_and_accepted_with_one_answer():
    """temperature 0 with several samples per prompt: identical answers, and vLLM refuses n > 1
    greedy requests (the group-native rlvr workflow's): refused before start, in RL as in evaluation."""
    with pytest.raises(ConfigError, match=r"temperature=0 \(greedy\) with trainer.samples_per_prompt=16"):
        validate(load_config(ROOT / "launch" / "cpu_default.yaml", ["rollout.sampling.temperature=0"]), has_cuda=False)
    validate(load_config(ROOT / "launch" / "cpu_default.yaml", ["rollout.sampling.temperature=0",
                                                                 "trainer.samples_per_prompt=1"]), has_cuda=False)
    validate(_cfg("rollout.sampling.temperature=0", "eval.samples_per_prompt=1"), has_cuda=False)


def test_on_gpus_the_engines_take_their_devices_and_no_transformer_engine_is_needed(monkeypatch):
    """No trainer: no Transformer Engine check (a CUDA machine without TE evaluates), the layout
    counts the engines' GPUs only, and they must fit the machine."""
    over = ("cluster.gpus_per_node=4", "rollout.num_engines=2", "rollout.engine_tp=2", "rollout.cpu_kv_cache_gb=1")
    layout = _check(*over, has_cuda=True, has_te=False)
    assert (layout.trainer_devices, layout.rollout_devices, layout.total_devices) == (0, 4, 4)
    with pytest.raises(ConfigError, match="cannot host the evaluation's engines"):
        _check("cluster.gpus_per_node=2", "rollout.num_engines=2", "rollout.engine_tp=2", has_cuda=True, has_te=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = _cfg(*over)
    p = local_placement(cfg, validate(cfg, has_cuda=True, has_te=False))
    assert p.engine_devices == [[4, 5], [6, 7]] and p.trainer_env == {} and p.spawn_trainer is None


def test_a_judge_gets_the_gpus_after_the_policys_engines(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg("cluster.gpus_per_node=3", "rollout.num_engines=1", "workflow.reward=reward_model",
               "reward_model.hf_dir=builtin:tiny-llama", "reward_model.num_engines=2")
    assert local_placement(cfg, validate(cfg, has_cuda=True, has_te=False)).engine_devices == [[0], [1], [2]]


def _dry_run(capsys, *overrides):
    from mlrl.launch import main

    rc = main(["--config", str(ROOT / "launch" / "eval_cpu.yaml"), *BASE, "--dry-run", *overrides])
    return rc, capsys.readouterr().out


def test_dry_run_plans_the_engines_alone(capsys):
    """--dry-run of an evaluation: no trainer, the engines' placement and memory, and the verdict."""
    rc, out = _dry_run(capsys)
    assert rc == 0 and "no trainer (an evaluation)" in out and out.splitlines()[-1] == "fits"
    assert "KV cache 1 GiB (cpu_kv_cache_gb) = " in out
    qwen = ["model.hf_dir=Qwen/Qwen3-8B", "model.arch=Qwen/Qwen3-8B", "model.dtype=bfloat16", "cluster.gpus_per_node=8",
            "rollout.num_engines=3", "rollout.engine_tp=2", "rollout.max_model_len=8192"]
    rc, out = _dry_run(capsys, *qwen)
    assert rc == 0 and "3 engine(s) x engine_tp 2: GPUs 0-1, 2-3, 4-5" in out and out.splitlines()[-1] == "fits"
    assert "weights 7.63 + activations" in out  # 8.19 B bf16 parameters over 2 GPUs
    # a judge's engines take the GPUs after the policy's
    rc, out = _dry_run(capsys, *qwen, "workflow.reward=reward_model", "reward_model.hf_dir=builtin:tiny-llama",
                       "reward_model.num_engines=1", "reward_model.engine_tp=2")
    assert rc == 0 and "judge (generative) builtin:tiny-llama (llama, " in out and "engine_tp 2: GPUs 6-7" in out
    assert "memory   judge (generative) engine GPU: weights 0.00" in out
    # fp32 weights of 8 B parameters (30.5 GiB) on one 40 GiB GPU leave a KV cache smaller than one sequence
    rc, out = _dry_run(capsys, *qwen[:2], "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=40",
                       "rollout.max_model_len=8192")
    assert rc == 3 and out.splitlines()[-1].startswith("DOES NOT FIT: policy engine: its KV cache holds 7105 tokens, "
                                                       "less than one sequence of max_model_len 8192")
    rc, out = _dry_run(capsys, *qwen[:2], "cluster.gpus_per_node=2", "cluster.gpu_memory_gb=40",
                       "rollout.max_model_len=8192", "rollout.engine_tp=2")  # (the remedy the message names)
    assert rc == 0 and out.splitlines()[-1] == "fits"


def test_dry_run_names_each_pools_own_fields_and_plans_around_a_judge_not_here(capsys):
    rc, out = _dry_run(capsys, "workflow.reward=reward_model", "reward_model.hf_dir=/nonexistent/judge")
    assert rc == 0 and "judge (generative) /nonexistent/judge: 1 engine(s) x engine_tp 1; not sized " \
        "(reward_model.hf_dir: folder '/nonexistent/judge' does not exist" in out
    # 1 GiB GPUs: the CUDA runtime alone takes more than gpu_memory_utilization leaves; each pool's advice
    # names its own fields
    rc, out = _dry_run(capsys, "cluster.gpus_per_node=2", "cluster.gpu_memory_gb=1", "workflow.reward=reward_model",
                       "reward_model.hf_dir=builtin:tiny-llama")
    verdict = out.splitlines()[-1]
    assert rc == 3 and "policy engine: its KV cache holds 0 tokens" in verdict
    assert "(more GPUs per engine (rollout.engine_tp), a larger rollout.gpu_memory_utilization, or a smaller " \
        "rollout.max_model_len)" in verdict
    assert "judge (generative) engine: its KV cache holds 0 tokens" in verdict
    assert "reward_model.max_model_len" in verdict
    rc, out = _dry_run(capsys, "rollout.max_model_len=300000000")  # (CPU: more than 1 GiB of KV holds)
    assert rc == 3 and "a larger rollout.cpu_kv_cache_gb, or a smaller rollout.max_model_len" in out


@pytest.mark.parametrize("stage,says", [("starting", "no prompt was answered"),
                                        ("answering", "eval_samples.jsonl.partial"),
                                        ("done", "the evaluation had finished")])
def test_sigterm_says_where_the_answers_are(monkeypatch, capsys, tmp_path, stage, says):
    import os
    import signal

    from mlrl.jobs import evaluate as ev

    async def fake_run(cfg, early, state):
        state["at"] = stage
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)

    monkeypatch.setattr(ev, "begin", lambda cfg, layout: None)  # (no engine process)
    monkeypatch.setattr(ev, "_run", fake_run)
    cfg = _cfg(f"logging.run_dir={tmp_path}")
    assert ev.run(cfg, validate(cfg, has_cuda=False)) == 143
    assert says in capsys.readouterr().err


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i == 0))


def _episode(reward, status=EpisodeStatus.COMPLETED, truncated=False):
    if status != EpisodeStatus.COMPLETED:
        return EpisodeResult(status=status, info={"error": {"error_type": "ValueError", "error_message": "bad row"}})
    s = Sample(tokens=[5, 6, 7, 8, 0], loss_mask=[0, 0, 1, 1, 1], rollout_logprobs=[0.0] * 5, versions=[0] * 5,
               reward=reward, prompt_len=2, status=SampleStatus.TRUNCATED if truncated else SampleStatus.COMPLETED)
    return EpisodeResult(status=status, samples=[s])


def test_an_answer_record_says_what_was_answered_and_how_it_scored():
    row = {"messages": [{"role": "user", "content": "copy 7"}], "answer": "7"}
    ok = answer_record(3, 1, row, _episode(1.0, truncated=True), _Tok(), threshold=1.0)
    assert ok == {"prompt_index": 3, "sample": 1, "messages": row["messages"], "answer": "7", "response": "t7 t8",
                  "response_tokens": 3, "reward": 1.0, "correct": True, "status": "completed", "truncated": True}
    assert answer_record(0, 0, row, _episode(0.5), _Tok(), threshold=1.0)["correct"] is False
    assert answer_record(0, 0, row, _episode(0.5), _Tok(), threshold=0.5)["correct"] is True
    bad = answer_record(0, 0, row, _episode(0.0, EpisodeStatus.ERROR), _Tok(), threshold=1.0)
    assert (bad["status"], bad["reward"], bad["correct"], bad["response"], bad["error"]) == (
        "error", None, False, None, "ValueError: bad row")


def test_answers_are_written_in_prompt_order_as_groups_finish():
    """Groups finish out of order; each is written once every group before it is, so a stopped
    evaluation's file is a prefix of the prompts, in order."""
    rows = [{"messages": [{"role": "user", "content": str(i)}], "delay": d} for i, d in enumerate((0.06, 0.0, 0.03))]
    seen_at_finish: list[int] = []
    buf = io.StringIO()

    class Runner:
        async def run_group(self, row, n, evaluation=False):
            assert evaluation
            await asyncio.sleep(row["delay"])
            seen_at_finish.append(len(buf.getvalue().splitlines()))
            return GroupResult("g", row, [_episode(1.0) for _ in range(n)])

    groups = asyncio.run(answer(Runner(), rows, 2, AnswerWriter(buf, _Tok(), 1.0)))
    assert [g.data for g in groups] == rows
    recs = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [(r["prompt_index"], r["sample"]) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert seen_at_finish == [0, 0, 0]  # rows 1 and 2 finished first and waited for row 0
