"""Rank side of the trainer: everything here runs inside a Megatron-Core rank process (or, for
`conversion`, a tools/ process that builds the model in-process) and may import megatron."""
