"""One-rank torchrun worker for the LoRA tests of test_convert_checkpoint.py: a real LoRA training
checkpoint to convert, and a full-weights one to refuse LoRA options on.

    python -m torch.distributed.run --nproc-per-node 1 lora_ckpt_worker.py --out DIR --work DIR

Writes under --work:
- lora_ckpt/        LoRA (rank 8, alpha 16, all-linear) on builtin:tiny-llama after two Adam
                    steps of a policy-gradient loss (B != 0): adapters + optimizer state only
- full_ckpt/        the frozen base saved as a full-weights checkpoint
- lora_logits.pt    the trained policy's logits [S, V] on conversion.probe_micro_batch (what a
                    correct conversion reproduces)
and `<out>/rank0.json`: how far training moved those logits from the base's.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from hf_reference import make_step, pg_loss

LORA = {"rank": 8, "alpha": 16.0}
TRAIN = dict(lr=2e-2, lr_warmup_steps=0, grad_clip=0.0, total_steps=10, use_distributed_optimizer=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    result: dict = {}
    try:
        result = run(Path(args.work))
    except Exception:
        result["error"] = traceback.format_exc()
        raise
    finally:
        Path(args.out, "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(work: Path) -> dict:
    from mlrl.config.schema import Config, LoRAConfig
    from mlrl.config.validate import resolve_layout
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.trainer.rank.conversion import probe_micro_batch
    from mlrl.trainer.rank.dist_ckpt import save_checkpoint
    from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

    cfg = Config()
    hf_dir = resolve_model_dir(cfg.model.hf_dir)  # builtin:tiny-llama
    cfg.cluster.trainer_devices = 1
    for k, v in TRAIN.items():
        setattr(cfg.trainer, k, v)
    layout = resolve_layout(cfg)
    init_parallel(cfg.parallel, layout, seed=1234)
    base = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=hf_dir, trainable=False)
    save_checkpoint(base, work / "full_ckpt")

    cfg.model.lora = LoRAConfig(**LORA)
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=hf_dir, trainable=True)
    vocab = policy.arch.vocab_size
    losses = [policy.update(make_step(vocab, n_samples=6, n_micro=2, seed=20 + k), pg_loss)["loss"]
              for k in range(2)]
    save_checkpoint(policy, work / "lora_ckpt")
    probe = [probe_micro_batch(vocab)]
    logits = policy.compute_logits(probe)[0]
    torch.save(logits, work / "lora_logits.pt")
    return {"losses": losses, "moved": float((logits - base.compute_logits(probe)[0]).abs().max())}


if __name__ == "__main__":
    main()
