"""The names in a checkpoint folder, and how to tell a complete checkpoint. Read-only: the
ordering that makes a checkpoint complete (write, COMPLETE, rename, `latest`) is kept by
mlrl.checkpoint.manager, the shards' own ordering (META_FILE last) by mlrl.trainer.rank.dist_ckpt.

    <root>/step_000004/            complete: holds COMPLETE and STATE_FILE (written before the rename)
      model_optim/                 TRAINER_DIR: the policy's shards (megatron-core dist-checkpointing)
        metadata.json, .metadata   MEGATRON_FILES: written by megatron-core once every shard is
        mlrl_checkpoint.json       META_FILE ("format": FORMAT): written last, by rank 0
      critic/                      CRITIC_DIR: the value model's shards (PPO with GAE), same format
    <root>/latest                  text file: the name of the newest complete checkpoint
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step_(\d{6,})$")

CRITIC_DIR = "critic"          # step_N/critic/: the value model's training state (PPO with GAE)
ADAPTER_DIR = "adapter"        # <run>/hf/step_N/adapter/: a LoRA run's PEFT folder inside its HF export
TRAINER_DIR = "model_optim"    # step_N/model_optim/: the policy's training state

META_FILE = "mlrl_checkpoint.json"
FORMAT = "mlrl-megatron-dist/1"
MEGATRON_FILES = ("metadata.json", ".metadata")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete `step_N` folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found, key=lambda sp: sp[0])]


def latest_checkpoint(root: Path) -> Path | None:
    """Newest complete checkpoint, by step. The folders decide, not the `latest` pointer: a commit
    renames the folder into place before it moves the pointer, so a process killed between the two
    leaves the pointer one checkpoint behind (and a run resumed from it would stand beside a newer
    one). The pointer is for people and tools that read the folder."""
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None
