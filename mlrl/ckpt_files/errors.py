"""The one error type of checkpoint files, raised on both sides of the trainer boundary (the
driver's CheckpointManager, the ranks' dist-checkpoint loads, tools/convert_checkpoint.py)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this run; the message says which."""
