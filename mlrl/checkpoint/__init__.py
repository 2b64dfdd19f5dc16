"""Checkpoints, in one place: layout and atomic commit (manager), the loop's save / commit /
export policy (checkpointer), Hugging Face folder writing (hf_export).

Megatron-specific save/load calls live behind the trainer boundary
(mlrl.trainer.rank.checkpointing, reached through `Policy.save_checkpoint` / `load_checkpoint` /
`export_hf`); this package decides where things go and when they become visible.
"""

from mlrl.checkpoint.checkpointer import Checkpointer, check_resume_has_critic
from mlrl.checkpoint.manager import CheckpointError, CheckpointManager, read_state

__all__ = ["CheckpointError", "CheckpointManager", "Checkpointer", "check_resume_has_critic", "read_state"]
