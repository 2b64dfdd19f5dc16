"""Supervised fine-tuning end to end: `python -m mlrl.launch --config launch/sft_cpu.yaml` (real
megatron-core ranks, no engines).

Run A: 4 steps straight (TP1). Run B: 2 steps with a checkpoint, then the same command with
total_steps=4 resumes it: steps 3-4 equal A's bit for bit (weights, optimizer, data position).
Run C: TP2 (two ranks), 2 steps. Asserted: the SFT loss falls, eval loss is logged, the HF export
loads in transformers, a data file with a row lacking an assistant turn is trained on the other
rows with a warning naming the row.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.launching import launch, metrics

COMMON = ["--config", "launch/sft_cpu.yaml", "logging.progress_bar=false", "sft.batch_size=32",
          "data.eval_every=2", "data.num_synthetic=128", "trainer.lr_warmup_steps=1"]


def _launch(run_dir: Path, *overrides: str):
    return launch(run_dir, *COMMON, *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A beside B's chain (two launches at a time: most of a launch is the trainer ranks starting)."""
    root = tmp_path_factory.mktemp("sft")

    def chain_b():
        _launch(root / "b", "trainer.total_steps=2")
        _launch(root / "b", "trainer.total_steps=4")

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(_launch, root / "a", "trainer.total_steps=4"), pool.submit(chain_b)]:
            f.result()
    return root


def test_loss_falls_and_eval_is_logged(runs):
    a = metrics(runs / "a")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert a[-1]["sft/loss"] < a[0]["sft/loss"]
    assert [r["step"] for r in a if "eval/loss" in r] == [2, 4]
    # sft.batch_size=32 copy_digit conversations, 2 trained tokens each (the digit and the template's " .")
    assert {r["sft/loss_tokens"] for r in a} == {64.0}


def test_resume_continues_bit_for_bit(runs):
    a, b = metrics(runs / "a"), metrics(runs / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ("sft/loss", "train/grad_norm", "train/lr", "sft/tokens"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
        if "eval/loss" in ra:
            assert ra["eval/loss"] == rb["eval/loss"]


def test_hf_export_loads_in_transformers(runs):
    import torch
    import transformers

    export = runs / "a" / "hf" / "step_000004"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert tok.chat_template  # the model's chat template travels with the export
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 6]])).logits).all()


def test_tp2_and_rows_without_assistant_turn(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"}]}] * 8
    rows.insert(2, {"messages": [{"role": "user", "content": "copy 5"}]})  # nothing to learn from
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _launch(tmp_path / "run", "trainer.total_steps=2", "parallel.tp=2", f"data.train={data}",
                  "data.eval=null", "sft.batch_size=4")
    assert "skipped 1 row(s) without an assistant turn" in out.stderr and "train.jsonl:3" in out.stderr
    recs = metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["sft/loss"] < recs[0]["sft/loss"]
    assert {r["sft/loss_tokens"] for r in recs} == {8.0}  # sft.batch_size=4 conversations of 2 trained tokens


def test_trainer_startup_timeout_s_bounds_the_ranks_start(tmp_path):
    """trainer.startup_timeout_s reaches the trainer's start (the SFT and RL jobs alike): at 0.5 s a
    rank cannot import megatron and build its model, and the run fails naming the field; every other
    launch of the suite starts within the default 300 s."""
    import subprocess
    import sys

    from helpers.launching import ROOT

    cmd = [sys.executable, "-m", "mlrl.launch", *COMMON, "trainer.total_steps=2", "trainer.startup_timeout_s=0.5",
           f"logging.run_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "within 0.5 s" in out.stderr and "(trainer.startup_timeout_s)" in out.stderr, out.stderr[-3000:]
