"""Checkpoints: layout and atomic commit (manager), Hugging Face export (hf_export).

Megatron-specific save/load calls live in mlrl/trainer/ behind small functions; this package
only decides where things go and when they become visible.
"""

from mlrl.checkpoint.manager import CheckpointError, CheckpointManager, read_state

__all__ = ["CheckpointError", "CheckpointManager", "read_state"]
