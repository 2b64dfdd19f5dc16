"""A sequence-classification reward model served in the pool (`reward_model.kind=classifier`): real vLLM
engines with `--runner pooling` on a tiny LlamaForSequenceClassification (one label) built from the
tiny Llama with a seeded score head.

1. Parity: `ClassifierJudge.score` through the real `EnginePool` equals transformers' sigmoid of the
   same model's score on the same conversation (its chat template), within 1e-5 (fp32).
2. End to end: `python -m mlrl.launch ... workflow.reward=reward_model` scores every sample with it
   (no failures) and the rewards vary across samples.
"""

import asyncio

import pytest
from helpers.launching import launch, metrics

CONVERSATIONS = [("copy 3", "3"), ("copy 3", "7 7"), ("add 2 5", "7"), ("reverse 1 2", "2 1 .")]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    import torch
    import transformers

    from mlrl.modelzoo import resolve_model_dir

    src = resolve_model_dir("builtin:tiny-llama")
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.num_labels, cfg.architectures, cfg.pad_token_id = 1, ["LlamaForSequenceClassification"], 0
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification.from_pretrained(src, config=cfg, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.mul_(20.0)  # spread the scores: rewards far from 0.5 and from each other
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out, model.eval()


def test_served_scores_equal_transformers(reward_model, tmp_path):
    import torch

    from mlrl.config.schema import RolloutConfig
    from mlrl.reward.model import ClassifierJudge
    from mlrl.rollout.pool import EnginePool
    from mlrl.workflow import load_hf_tokenizer

    folder, hf = reward_model
    tok = load_hf_tokenizer(str(folder))

    async def served() -> list[float]:
        async with EnginePool(RolloutConfig(max_model_len=256), folder, runner="pooling", run_dir=tmp_path) as pool:
            judge = ClassifierJudge(pool, tok)
            return list(await asyncio.gather(*(judge.score(q, r) for q, r in CONVERSATIONS)))

    got = asyncio.run(served())
    judge = ClassifierJudge(None, tok)
    with torch.no_grad():
        want = [float(torch.sigmoid(hf(torch.tensor([judge.conversation_ids(q, r)])).logits[0, 0]))
                for q, r in CONVERSATIONS]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    assert max(want) - min(want) > 0.05  # the conversations score differently: the check can fail


def test_a_run_scores_every_sample_with_the_classifier(reward_model, tmp_path):
    folder, _ = reward_model
    launch(tmp_path / "run", "logging.progress_bar=false", f"reward_model={{hf_dir: {folder}, kind: classifier}}",
           "workflow.reward=reward_model", "trainer.total_steps=2", "checkpoint.save_at_end=false",
           "checkpoint.hf_export_at_end=false")
    for r in metrics(tmp_path / "run"):
        assert r["reward_model/calls"] == r["groups/samples"] == 512 and r["reward_fn/failures"] == 0
        assert r["reward_model/engine_errors"] == 0 and "reward_model/reply_tokens_mean" not in r
        assert 0 < r["reward/mean"] < 1 and r["reward/std"] > 0.01 and r["timing/reward/model"] > 0
