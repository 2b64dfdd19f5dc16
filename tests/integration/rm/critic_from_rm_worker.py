"""torchrun worker for test_rm_run.py: a PPO critic started from a reward model's HF export
(critic.hf_dir = a one-label *ForSequenceClassification). Builds the MegatronCritic on the folder
and writes, for a micro-batch of seeded token rows, the critic's initial values and transformers'
classifier scores of every prefix, to `<out>/rank<r>.json` (the assertions live in the test).

    python -m torch.distributed.run --nproc-per-node 1 critic_from_rm_worker.py --out DIR --rm HF_DIR
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rm", required=True)
    args = ap.parse_args()
    results: dict = {}
    try:
        from mlrl.config.schema import CriticConfig
        from mlrl.trainer.rank.conversion import conversion_config, probe_micro_batch
        from mlrl.trainer.rank.critic import MegatronCritic
        from mlrl.trainer.rank.policy import init_parallel

        cfg, layout = conversion_config(args.rm, tp=1, pp=1, ep=1, model_dtype="float32")
        init_parallel(cfg.parallel, layout, seed=1234)
        critic = MegatronCritic(cfg.model, CriticConfig(), cfg.parallel, cfg.trainer, layout, hf_dir=args.rm)
        config = json.loads((Path(args.rm) / "config.json").read_text())
        mb = probe_micro_batch(config["vocab_size"], n_samples=2, length=10, seed=3)
        mb.tokens = 3 + mb.tokens % (config["vocab_size"] - 3)  # no pad / BOS / EOS ids: every prefix ends in a token
        values = critic.compute_values([mb])[0]
        import transformers

        hf = transformers.AutoModelForSequenceClassification.from_pretrained(args.rm, dtype=torch.float32).eval()
        cu = mb.cu_seqlens.tolist()
        prefix_scores = []
        with torch.no_grad():
            for a, b in zip(cu[:-1], cu[1:]):
                # the value of token t (the state it was generated in) = the score of the tokens before it
                prefix_scores.append([0.0] + [float(hf(mb.tokens[a:t][None]).logits[0, 0]) for t in range(a + 1, b)])
        results = {"values": values.tolist(), "prefix_scores": [s for row in prefix_scores for s in row]}
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        Path(args.out, "rank0.json").write_text(json.dumps(results))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
