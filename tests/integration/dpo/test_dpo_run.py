"""DPO end to end: `python -m mlrl.launch --config launch/dpo_cpu.yaml` with the tiny Llama (real
megatron-core ranks with a frozen reference copy, no engines) on preference pairs from the copy task
(chosen: the digit, rejected: another digit).

Run A: 8 steps (DPO, beta 0.1). Run B: 4 steps with a checkpoint, then the same command with
total_steps=8 resumes it: steps 5-8 equal A's bit for bit. Run C: beta 1.0. Run D: IPO. Run E:
LoRA (the reference is the base with the adapters off). Asserted: the chosen-rejected margin grows
(train and held out), the HF export loads in transformers, and each knob moves the outcome the way
theory says.
"""

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.launching import launch, metrics

COMMON = ["--config", "launch/dpo_cpu.yaml", "logging.progress_bar=false", "model.hf_dir=builtin:tiny-llama",
          "dpo.max_seq_tokens=64", "data.train=synthetic:copy_digit", "data.eval=synthetic:copy_digit",
          "data.num_synthetic=128", "dpo.batch_size=16", "trainer.lr=1e-3", "trainer.lr_warmup_steps=1",
          "data.eval_every=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches at a time (most of a launch is the trainer rank starting): B's chain beside A, C, D."""
    root = tmp_path_factory.mktemp("dpo")
    short = ["trainer.total_steps=4", "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false"]

    def chain_b():
        launch(root / "b", *COMMON, "trainer.total_steps=4")
        launch(root / "b", *COMMON, "trainer.total_steps=8")

    def the_others():
        launch(root / "a", *COMMON, "trainer.total_steps=8")
        launch(root / "c", *COMMON, *short, "dpo.beta=1.0")
        launch(root / "d", *COMMON, *short, "dpo.loss_type=ipo")

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(chain_b), pool.submit(the_others)]:
            f.result()
    return root


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_the_margin_grows(runs):
    a = metrics(runs / "a")
    assert [r["step"] for r in a] == list(range(1, 9))
    assert abs(a[0]["dpo/loss"] - math.log(2)) < 1e-6  # the policy starts as its reference
    assert a[0]["dpo/reward_margin"] == 0.0 and a[0]["dpo/pairs"] == 16
    assert _mean(a[-3:], "dpo/reward_margin") > max(0.0, _mean(a[1:4], "dpo/reward_margin"))
    assert _mean(a[-3:], "dpo/loss") < a[0]["dpo/loss"] - 0.02
    # held out: eval at steps 4 and 8, the margin and the preference accuracy rise
    ev = [r for r in a if "eval/reward_margin" in r]
    assert [r["step"] for r in ev] == [4, 8]
    assert ev[1]["eval/reward_margin"] > ev[0]["eval/reward_margin"] > 0
    assert ev[1]["eval/reward_accuracy"] >= ev[0]["eval/reward_accuracy"] > 0.5
    assert ev[1]["eval/dpo_loss"] < ev[0]["eval/dpo_loss"] < math.log(2)
    assert ev[1]["eval/chosen_reward"] > ev[1]["eval/rejected_reward"]
    assert {"timing/reference", "timing/train", "timing/eval", "timing/checkpoint"} <= set(a[-1])


def test_resume_continues_bit_for_bit(runs):
    a, b = metrics(runs / "a"), metrics(runs / "b")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        for k in ("dpo/loss", "dpo/reward_margin", "train/grad_norm", "train/lr", "dpo/tokens"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


def test_hf_export_loads_in_transformers(runs):
    import torch
    import transformers

    export = runs / "a" / "hf" / "step_000008"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 6]])).logits).all()


def test_beta_scales_the_reward_and_the_constraint(runs):
    a, c = metrics(runs / "a")[:4], metrics(runs / "c")
    assert a[0]["dpo/loss"] == pytest.approx(c[0]["dpo/loss"], abs=1e-7)  # both log 2 at the reference
    # beta 1.0: implicit rewards are beta * log-ratio, so the same movement is worth 10x the margin,
    # and the loss (-log sigmoid(beta h)) falls faster; measured on the 128 held-out pairs at step 4
    assert c[-1]["eval/reward_margin"] > 2 * a[-1]["eval/reward_margin"] > 0
    assert c[-1]["eval/dpo_loss"] < a[-1]["eval/dpo_loss"] < math.log(2)


def test_ipo_is_another_loss_that_also_learns(runs):
    a, d = metrics(runs / "a")[:4], metrics(runs / "d")
    # IPO at the reference: (0 - 1 / (2 beta))^2 = 25 for beta 0.1, not DPO's log 2
    assert d[0]["dpo/loss"] == pytest.approx(25.0, rel=1e-6) and a[0]["dpo/loss"] == pytest.approx(math.log(2))
    assert d[-1]["eval/dpo_loss"] < d[0]["dpo/loss"] and d[-1]["eval/reward_margin"] > 0
    assert d[-1]["eval/reward_accuracy"] > 0.5


def test_lora_trains_adapters_against_the_base(tmp_path):
    out = launch(tmp_path / "e", *COMMON, "trainer.total_steps=4", "model.lora={rank: 8, alpha: 16}",
                 "trainer.lr=1e-2", "data.eval=null", "data.eval_every=0", "checkpoint.save_at_end=false")
    e = metrics(tmp_path / "e")
    assert abs(e[0]["dpo/loss"] - math.log(2)) < 1e-6  # adapters start at 0: policy == base == reference
    assert e[-1]["dpo/reward_margin"] > 0 and e[-1]["dpo/loss"] < e[0]["dpo/loss"]
    assert (tmp_path / "e" / "hf" / "step_000004").is_dir(), out.stdout[-2000:]
