"""Checkpoints, the driver's side: layout and atomic commit (manager), the loop's save / commit /
export policy (checkpointer), the model.init_from check before any process starts (init_from).

Megatron-specific save/load calls live behind the trainer boundary
(mlrl.trainer.rank.dist_ckpt and mlrl.trainer.rank.hf_export, reached through
`Policy.save_checkpoint` / `load_checkpoint` / `export_hf`); this package decides where things go
and when they become visible. What both sides read and write (the folder's names, the HF and PEFT
folder writers, CheckpointError, the init_from source check) is mlrl.ckpt_files.
"""

from mlrl.checkpoint.checkpointer import Checkpointer, check_resume_has_critic
from mlrl.checkpoint.manager import CheckpointManager, read_state
from mlrl.ckpt_files.errors import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "Checkpointer", "check_resume_has_critic", "read_state"]
