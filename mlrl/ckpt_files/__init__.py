"""The files of checkpoints and exports, shared by both sides of the trainer boundary: their names
and layout, the checks that read them, and the writers that produce them.

Neutral ground: imported by the driver (mlrl.checkpoint, tools/) and by the trainer ranks
(mlrl.trainer.rank), it imports neither (tests/unit/test_import_boundaries.py keeps it so). What
lives here is plain files and JSON (torch and safetensors for the tensor files), never a process,
a collective or Megatron.

    errors        CheckpointError: a checkpoint is missing, incomplete or does not fit this run
    layout        the names in a checkpoint folder and how to tell a complete one (read-only)
    init_source   model.init_from: which weights a path names (the driver checks, the ranks load)
    atomic        a JSON file written whole (a checkpoint's state, an evaluation's metrics)
    hf_folder     a Hugging Face folder from streamed tensor buckets (safetensors shards, atomic)
    peft_adapter  LoRA adapters as a PEFT folder (atomic)

The driver's side (where and when a checkpoint is saved, the atomic commit, keep-last-k) is
mlrl.checkpoint; the ranks' side (megatron-core dist-checkpointing, the streamed exports) is
mlrl.trainer.rank.dist_ckpt and mlrl.trainer.rank.hf_export.
"""
