"""Reward-model training end to end: `python -m mlrl.launch --config launch/rm_cpu.yaml` with the tiny
Llama (real megatron-core ranks, a scalar head in place of the LM head, no engines) on preference pairs
from the copy task (chosen: the prompt's digit, rejected: another digit).

Run A: 12 steps. Run B: 6 steps with a checkpoint, then the same command with total_steps=12 resumes
it: steps 7-12 equal A's bit for bit. Run C: rm.center_rewards_coefficient=0.01. Runs tp2sp / pp2: 4
steps on other layouts, equal to A's. Asserted: the held-out
accuracy and margin rise; the HF export is a LlamaForSequenceClassification whose scores in
transformers equal the trainer's and which vLLM's pooling runner serves with the same scores (what an
RL run's `reward_model: {kind: classifier}` reads); centring pulls the scores toward 0.
"""

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.launching import ROOT, launch, metrics

STEPS = 12
COMMON = ["--config", "launch/rm_cpu.yaml", "logging.progress_bar=false", "model.hf_dir=builtin:tiny-llama",
          "rm.max_seq_tokens=64", "data.train=synthetic:copy_digit", "data.eval=synthetic:copy_digit",
          "data.num_synthetic=128", "rm.batch_size=16", "trainer.lr=1e-3", "trainer.lr_warmup_steps=1",
          "data.eval_every=4"]


LAYOUTS = {"tp2sp": ["parallel.tp=2", "parallel.sequence_parallel=true"], "pp2": ["parallel.pp=2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two launches at a time (most of a launch is the trainer rank starting): B's chain and PP2 beside
    A, C and TP2."""
    root = tmp_path_factory.mktemp("rm")

    def layout(name):
        launch(root / name, *COMMON, "trainer.total_steps=4", "checkpoint.save_at_end=false", *LAYOUTS[name])

    def chain_b():
        launch(root / "b", *COMMON, f"trainer.total_steps={STEPS // 2}")
        launch(root / "b", *COMMON, f"trainer.total_steps={STEPS}")
        layout("pp2")

    def the_others():
        launch(root / "a", *COMMON, f"trainer.total_steps={STEPS}")
        launch(root / "c", *COMMON, f"trainer.total_steps={STEPS}", "rm.center_rewards_coefficient=0.01",
               "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false")
        layout("tp2sp")

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(chain_b), pool.submit(the_others)]:
            f.result()
    return root


def _evals(rows):
    return [r for r in rows if "eval/rm_accuracy" in r]


def test_the_reward_model_learns_to_prefer_the_right_answer(runs):
    a = metrics(runs / "a")
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    # a fresh head (normal, std 0.02) scores both sides alike: about log 2 and no margin to speak of
    assert abs(a[0]["rm/loss"] - math.log(2)) < 0.05 and abs(a[0]["rm/margin"]) < 0.1 and a[0]["rm/pairs"] == 16
    assert sum(r["rm/loss"] for r in a[-3:]) / 3 < a[0]["rm/loss"] - 0.05
    ev = _evals(a)
    assert [r["step"] for r in ev] == [4, 8, 12]
    # measured: accuracy 0.68 -> 0.73 -> 0.80, margin 0.02 -> 0.32 -> 1.06
    assert ev[-1]["eval/rm_accuracy"] > 0.7 and ev[-1]["eval/rm_accuracy"] > ev[0]["eval/rm_accuracy"]
    assert ev[-1]["eval/rm_margin"] > ev[0]["eval/rm_margin"] > 0
    assert ev[-1]["eval/rm_loss"] < math.log(2) - 0.1


def test_a_resumed_run_continues_bit_for_bit(runs):
    a, b = metrics(runs / "a"), metrics(runs / "b")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):  # (B's first launch also evaluates at its last step, 6)
        for k in ("rm/loss", "rm/margin", "rm/accuracy", "train/grad_norm") + (("eval/rm_loss",) if "eval/rm_loss" in ra
                                                                              else ()):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


@pytest.mark.parametrize("name", LAYOUTS)
def test_other_layouts_train_the_same_model_and_export_it(runs, name):
    """TP2 with sequence parallelism (the head's output gathered along the sequence, its gradient summed
    over TP) and PP2 (the head on the last stage, its weight exported from there): the same losses as
    TP1 / PP1 to float32 rounding (measured: equal to 7 digits), and the layout's export scores as the run."""
    import torch
    import transformers

    a, other = metrics(runs / "a")[:4], metrics(runs / name)
    for ra, ro in zip(a, other):
        assert abs(ra["rm/loss"] - ro["rm/loss"]) < 1e-5 and abs(ra["rm/margin"] - ro["rm/margin"]) < 1e-5
    folder = runs / name / "hf" / "step_000004"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    pairs = _held_out(transformers.AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        chosen = [float(model(torch.tensor([p["chosen"][0]])).logits[0, 0]) for p in pairs]
    assert abs(sum(chosen) / len(chosen) - other[-1]["eval/rm_chosen_score"]) < 1e-5


def test_centring_pulls_the_scores_toward_zero(runs):
    """The pairwise loss fixes only differences; with the centring term (TRL's suggested 0.01) the
    held-out scores' mean sits nearer 0 (measured over the 3 held-out passes: mean |mean score| 1.15
    without, 0.12 with). Its cost at this scale is asserted nowhere but measured: the fresh head's
    offset (-1.6) is worked off first, and held-out accuracy after 12 steps is 0.56 against 0.80."""
    def off_centre(rows):
        ev = _evals(rows)
        return sum(abs(r["eval/rm_chosen_score"] + r["eval/rm_rejected_score"]) / 2 for r in ev) / len(ev)

    a, c = metrics(runs / "a"), metrics(runs / "c")
    assert off_centre(c) < 0.5 * off_centre(a), (off_centre(a), off_centre(c))


def _held_out(tokenizer):
    """The run's held-out pairs, tokenised as the run did (the same split, seed and length cut)."""
    from mlrl.config import load_config
    from mlrl.data import get_dataset

    cfg = load_config(ROOT / "launch" / "rm_cpu.yaml", [a for a in COMMON[2:] if "=" in a])
    return get_dataset("synthetic:copy_digit", "test", "dpo", tokenizer, 64, seed=cfg.trainer.seed,
                       num_rows=cfg.data.num_synthetic).examples


@pytest.fixture(scope="module")
def export(runs):
    import torch
    import transformers

    folder = runs / "a" / "hf" / f"step_{STEPS:06d}"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pairs = _held_out(tok)
    with torch.no_grad():
        scores = [[float(model(torch.tensor([p[s][0]])).logits[0, 0]) for s in ("chosen", "rejected")] for p in pairs]
    return folder, model, pairs, scores


def test_the_export_is_a_classifier_scoring_as_the_trainer(runs, export):
    folder, model, pairs, scores = export
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    last = _evals(metrics(runs / "a"))[-1]  # the held-out pass after the last update: the exported weights
    n = len(scores)
    assert n == 128
    assert abs(sum(c for c, _ in scores) / n - last["eval/rm_chosen_score"]) < 1e-5
    assert abs(sum(r for _, r in scores) / n - last["eval/rm_rejected_score"]) < 1e-5
    assert sum(c > r for c, r in scores) / n == last["eval/rm_accuracy"]


def test_vllm_serves_the_export_with_the_same_scores(export, tmp_path):
    """The pooling runner (what `reward_model: {kind: classifier}` starts) returns sigmoid(score) of
    the last token: equal to transformers' within fp32 noise, so the RL reward is the trained model's."""
    from mlrl.config.schema import RolloutConfig
    from mlrl.rollout.pool import EnginePool

    folder, _, pairs, scores = export
    ids = [pairs[k][s][0] for k in range(6) for s in ("chosen", "rejected")]

    async def served() -> list[float]:
        async with EnginePool(RolloutConfig(max_model_len=256), folder, runner="pooling", run_dir=tmp_path) as pool:
            return [float((await pool.aclassify(x))[-1]) for x in ids]

    got = asyncio.run(served())
    want = [1 / (1 + math.exp(-s)) for k in range(6) for s in scores[k]]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_the_checkpoint_converts_to_the_same_classifier_on_another_layout(runs, tmp_path):
    """tools/convert_checkpoint.py mcore-to-hf on the reward model's TP1 training checkpoint, run at
    TP2: the same tensors and config the run exported, and --verify compares scores with transformers."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "mcore-to-hf", "--ckpt",
                        str(runs / "a" / "checkpoints"), "--out", str(out), "--tp", "2", "--verify", "--no-progress"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one-label *ForSequenceClassification reward model" in r.stdout and "world=2" in r.stdout
    gap = float(next(ln for ln in r.stdout.splitlines() if ln.startswith("verify ok: max |score difference|"))
                .split("| ")[1].split(" ")[0])
    assert gap < 1e-5
    exported = runs / "a" / "hf" / f"step_{STEPS:06d}"
    a, b = load_file(str(out / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(a) == sorted(b) and "score.weight" in a and "lm_head.weight" not in a
    assert all(a[k].equal(b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads((exported / "config.json").read_text())


def test_a_critic_starts_from_the_reward_model(runs):
    """critic.hf_dir = the reward model's export (the usual RLHF start of PPO's critic): the critic's
    body and value head are the reward model's, so a state's initial value is the reward model's score
    of the tokens so far (transformers' classifier on every prefix, 1e-5), not 0 as from a causal LM."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "integration" / "trainer"))
    from trainer_harness import run_torchrun

    export = runs / "a" / "hf" / f"step_{STEPS:06d}"
    (r,), _ = run_torchrun(Path(__file__).with_name("critic_from_rm_worker.py"), ["--rm", str(export)], 1,
                           timeout=300)
    values, want = r["values"], r["prefix_scores"]
    assert len(values) == len(want) == 20
    assert max(abs(a - b) for a, b in zip(values, want)) < 1e-5, (values, want)
    assert max(abs(v) for v in values) > 0.1  # the head was loaded: a fresh critic's values are exactly 0
