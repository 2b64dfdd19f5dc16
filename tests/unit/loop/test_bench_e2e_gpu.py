"""tools/bench_e2e_gpu.py's pure pieces, without a run: argument errors (one line, exit 2, before any
work), metrics.jsonl -> step statistics -> report and the refit_vs_copy ratio, the padded word
tokenizer, the parameter count from safetensors headers, the run's config (valid for mlrl on CPU,
and as a plan that fits one 80 GiB GPU for the default Qwen3-1.7B shape), and the fixed-length
workflow."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers.tools import TOOLS, load_tool
from transformers import AutoModelForCausalLM, AutoTokenizer

bench = load_tool("bench_e2e_gpu")
InputError = bench.InputError


# ---- arguments -----------------------------------------------------------------------------------------
def test_defaults_are_the_issue_s_gpu_bench():
    args = bench.parse_args(["--device", "cpu"])  # cpu: this machine has no GPU
    assert (args.prompts, args.group_size, args.max_new_tokens, args.steps, args.warmup, args.model_shape) == \
        (64, 8, 512, 3, 1, "qwen3-1.7b")
    with pytest.raises(InputError, match=r"^--device cuda: torch.cuda.is_available\(\) is False") as e:
        bench.parse_args([])  # the default device is cuda, refused here with the reason
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, flag", [
    (["--prompts", "0"], "--prompts=0"),
    (["--group-size", "1"], "--group-size=1"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["--steps", "0"], "--steps=0"),
    (["--warmup", "-1"], "--warmup=-1"),
    (["--timeout", "0"], "--timeout=0"),
    (["--model-shape", "gpt5"], "--model-shape 'gpt5'"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--prompts", "many"], "argument --prompts: invalid int value"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["trainer.lr"], "override 'trainer.lr'"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, flag):
    with pytest.raises(InputError) as e:
        bench.parse_args(["--device", "cpu", *argv])
    assert str(e.value).startswith(flag) and "\n" not in str(e.value), str(e.value)


def test_cuda_is_checked_only_for_cuda():
    args = bench.parse_args(["--device", "cpu"])
    args.device = "cuda"
    bench.check_args(args, cuda_available=lambda: True)
    with pytest.raises(InputError, match="--device cuda"):
        bench.check_args(args, cuda_available=lambda: False)


def test_the_program_exits_2_with_one_line_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_e2e_gpu.py"), "--device", "cpu", "--prompts", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["bench_e2e_gpu: --prompts=0: must be >= 1"]
    assert proc.stdout == "" and not list(tmp_path.iterdir())


# ---- metrics -> report ---------------------------------------------------------------------------------
def _record(step, *, samples=16.0, length=32.0, step_s=2.0, rollout=1.0, sync=0.25):
    return {"step": step, "groups/samples": samples, "response/tokens_mean": length, "response/truncated_frac": 1.0,
            "weight_sync/bytes": 4e9, "timing/step": step_s, "timing/rollout": rollout, "timing/rollout/phase": 1.1,
            "timing/reward": 0.0, "timing/logprobs": 0.2, "timing/train": 0.4, "timing/train/forward_backward": 0.3,
            "timing/sync": sync, "timing/sync/transfer": sync / 2, "timing/sleep": 0.01, "timing/wake": 0.02,
            "timing/offload": 0.03, "timing/reload": 0.04, "timing/other": 0.05, "reward/mean": 0.0}


def test_step_stats_skip_the_warmup_and_average_the_timed_steps():
    recs = [_record(1, step_s=60.0, sync=9.0), _record(2, step_s=2.0, sync=0.2),
            _record(3, step_s=4.0, sync=0.4, length=16.0)]
    st = bench.step_stats(recs, warmup=1)
    assert st.steps == [2, 3]
    assert st.gen_tokens == pytest.approx((16 * 32 + 16 * 16) / 2)  # samples x mean response length, per step
    assert st.mean_len == pytest.approx(24.0) and st.samples == 16.0 and st.truncated == 1.0
    assert st.step_s == pytest.approx(3.0) and st.refit_s == pytest.approx(0.3) and st.rollout_s == 1.0
    assert st.sync_bytes == 4e9
    assert set(st.phases) == {"rollout", "reward", "logprobs", "train", "sync", "sleep", "wake", "offload", "reload",
                              "other"}
    assert st.details == {"rollout/phase": pytest.approx(1.1), "train/forward_backward": pytest.approx(0.3),
                          "sync/transfer": pytest.approx(0.15)}


def test_step_stats_refuse_runs_without_timed_steps_or_metrics():
    with pytest.raises(ValueError, match="none after the 2 warm-up"):
        bench.step_stats([_record(1), _record(2)], warmup=2)
    broken = _record(2)
    del broken["timing/sync"]
    with pytest.raises(ValueError, match="step 2 lacks timing/sync"):
        bench.step_stats([_record(1), broken], warmup=1)


def test_report_numbers_and_last_line():
    st = bench.step_stats([_record(1), _record(2, samples=512.0, length=512.0, step_s=32.0, sync=1.5)], warmup=1)
    lines = bench.report(st, devices=1, device="cuda", copy_s=0.003, copy_bytes=4_063_232_000, memory="61.0 GiB",
                         max_new_tokens=512)
    text = "\n".join(lines)
    assert "generated tokens per step: 262144" in text
    assert "generated tok/s per GPU: 8192.0" in text  # 512 x 512 / 32 s / 1 GPU
    assert "generation tok/s: 262144.0" in text       # over timing/rollout = 1 s
    assert re.search(r"^  sync\s+1\.500\s+4\.7%$", text, re.M)
    assert re.search(r"^    transfer\s+0\.750$", text, re.M)  # sub-keys under their phase
    assert "refit (timing/sync): 1.500 s per step" in text and "peak memory: 61.0 GiB" in text
    assert "(1354.4 GB/s)" in text  # 4.06 GB in 3 ms
    assert lines[-1] == "ratio refit_vs_copy: 500.000"  # 1.5 s / 3 ms
    assert re.fullmatch(r"ratio refit_vs_copy: \d+\.\d+", lines[-1])
    half = bench.report(st, devices=2, device="cuda", copy_s=0.003, copy_bytes=1, memory="m", max_new_tokens=512)
    assert "generated tok/s per GPU: 4096.0" in "\n".join(half)


def test_ratio_refit_vs_copy():
    assert bench.ratio_refit_vs_copy(2.0, 0.5) == 4.0
    with pytest.raises(ValueError):
        bench.ratio_refit_vs_copy(1.0, 0.0)


def test_copy_seconds_on_cpu_is_positive():
    assert 0 < bench.copy_seconds(1 << 20, "cpu", repeats=3, warmup=1) < 1.0


# ---- the model folder ----------------------------------------------------------------------------------
def test_padded_word_tokenizer_matches_the_qwen_vocab(tmp_path):
    bench.write_tokenizer(tmp_path, 151936, 151643, 151645)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 151936
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (151643, 151645, 0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "copy 7"}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and max(ids) < 100  # the synthetic task's words are in the vocabulary
    assert tok.decode([151935, 100000, 151645], skip_special_tokens=True) == "<unused151935> <unused100000>"


def test_tokenizer_specials_inside_the_words_keep_their_names(tmp_path):
    bench.write_tokenizer(tmp_path, 256, 1, 2)  # the tiny Llama shape: LlamaConfig's bos 1 / eos 2
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (len(tok), tok.bos_token, tok.eos_token, tok.eos_token_id) == (256, "<s>", "</s>", 2)
    with pytest.raises(InputError, match="vocab_size 10"):
        bench.write_tokenizer(tmp_path / "small", 10, None, None)


def test_parameter_count_from_safetensors_headers(tmp_path):
    out = bench.write_model("tiny", tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert bench.safetensors_numel(out) == sum(p.numel() for p in model.parameters())  # tied embedding once
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size == 256


# ---- the run's config ----------------------------------------------------------------------------------
def _config(args, model_dir, tmp_path):
    from mlrl.config import load_config

    path = tmp_path / "bench.yaml"
    path.write_text(json.dumps(bench.run_config(args, model_dir, tmp_path / "run")))
    return load_config(path, [])


def test_cpu_config_is_a_valid_colocated_run(tmp_path):
    from mlrl.config import validate

    model = bench.write_model("tiny", tmp_path / "model")
    args = bench.parse_args(["--device", "cpu", "--prompts", "3", "--group-size", "2", "--max-new-tokens", "8"])
    cfg = _config(args, model, tmp_path)
    validate(cfg)
    assert (cfg.cluster.placement, cfg.cluster.gpus_per_node, cfg.weight_sync.transport, cfg.model.dtype) == \
        ("colocated", 0, "broadcast", "float32")
    assert (cfg.trainer.prompts_per_step, cfg.trainer.samples_per_prompt, cfg.trainer.total_steps) == (3, 2, 4)
    assert cfg.rollout.sampling.max_new_tokens == 8 and cfg.workflow.name == bench.WORKFLOW
    assert not cfg.checkpoint.save_at_end and not cfg.checkpoint.hf_export_at_end and cfg.algorithm.kl_coef > 0


def test_gpu_config_plans_to_fit_one_80gib_gpu(tmp_path):
    from mlrl.config import validate
    from mlrl.plan import make_plan

    model = tmp_path / "model"
    bench.shape_config("qwen3-1.7b").save_pretrained(model)  # the planner reads config.json only
    args = bench.parse_args(["--device", "cpu"])
    args.device = "cuda"
    cfg = _config(args, model, tmp_path)
    assert (cfg.cluster.gpus_per_node, cfg.weight_sync.transport, cfg.model.dtype, cfg.rollout.enforce_eager) == \
        (1, "cuda_ipc", "bfloat16", False)
    layout = validate(cfg, has_cuda=True, has_te=True)
    plan = make_plan(cfg, layout)
    assert plan.fits, plan.reasons


def test_fixed_length_workflow_sets_min_tokens_to_max_tokens():
    from mlrl.types import GenerationHyperparameters
    from mlrl.workflow import build_workflow

    wf = build_workflow(bench.WORKFLOW, tokenizer=object(), reward="exact_match",
                        gconfig=GenerationHyperparameters(max_new_tokens=512, temperature=1.0))
    assert type(wf).__name__ == "RLVRWorkflow"
    assert (wf.gconfig.max_new_tokens, wf.gconfig.min_new_tokens) == (512, 512)


def test_memory_peak_on_cpu_sums_the_process_tree_rss():
    mem = bench.MemoryPeak("cpu")
    mem.start(os.getpid())
    time.sleep(0.7)  # one sample every 0.5 s
    line = mem.stop()
    assert mem.peak > 50e6 and line.startswith(f"{mem.peak / bench.GiB:.2f} GiB host RSS"), line
