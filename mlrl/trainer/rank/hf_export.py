"""The policy's streamed Hugging Face export, and its LoRA adapters as a PEFT folder (rank side). A
reward model (mlrl.trainer.rank.reward_model) exports the same way as a one-label
`*ForSequenceClassification` folder: the body's tensors, its scalar head as `score.weight`, and the
config rewritten by `sequence_classifier_config`.

Every function is a collective over all trainer ranks, like the policy's methods:

    export_hf(policy, out_dir) -> Path | None             a complete HF folder (rank 0 finalizes)
    export_hf_shards(policy, folder) -> ShardMap | None   only this stage's safetensors files
    export_peft(policy, out_dir) -> Path | None           the LoRA adapters (rank 0 writes them)

The files are written by the neutral writers (mlrl.ckpt_files.hf_folder, .peft_adapter): the sender
of each pipeline stage streams its HF tensors bucket by bucket into size-capped safetensors shards
under a temporary folder beside `out_dir`, and rank 0, once every rank has reported, merges the
shard maps, checks the names and renames the folder into place, so an export appears whole or not
at all. The distributed checkpoint the policy is saved in (and exported from by
tools/convert_checkpoint.py) is mlrl.trainer.rank.dist_ckpt.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mlrl.bridge.arch import SCORE_WEIGHT
from mlrl.ckpt_files.hf_folder import (
    ShardMap,
    ShardWriter,
    finalize_hf_folder,
    sequence_classifier_config,
    temp_dir_for,
)
from mlrl.ckpt_files.peft_adapter import write_peft_adapter
from mlrl.trainer.rank.dist_ckpt import _base_hf_dir, model_role, via_mbridge

EXPORTABLE = ("policy", "reward_model")  # the roles whose weights are a Hugging Face model


def _export_dtype(policy, dtype: Optional[str]) -> Optional[torch.dtype]:
    """None = keep the parameters' dtype; "auto" = the dtype config.json declares."""
    if dtype is None:
        return None
    if dtype == "auto":
        dtype = policy.hf_config.get("dtype") or policy.hf_config.get("torch_dtype")
        if dtype is None:
            return None
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"HF export dtype {dtype!r}: expected float32, bfloat16 or float16") from None


def export_hf_shards(policy, folder: str | Path, *, max_shard_bytes: int = 2 << 30, bucket_bytes: int = 256 << 20,
                     dtype: Optional[str] = "auto") -> Optional[ShardMap]:
    """Collective. The sender of each pipeline stage writes its stage's HF tensors into
    `folder/stage<pp>-0000i.safetensors` and returns its shard map; other ranks return None.
    Peak memory per sender: one bucket being gathered plus one shard being filled."""
    role = model_role(policy)
    if role not in EXPORTABLE:
        raise ValueError(f"HF export of a {role}: only the policy (a causal LM) and a reward model (a sequence "
                         "classifier) are Hugging Face models")
    info = policy.rank_info()
    writer = None
    if info["is_stage_sender"]:
        writer = ShardWriter(folder, f"stage{info['pp']:03d}", max_shard_bytes=max_shard_bytes,
                             dtype=_export_dtype(policy, dtype))
    for bucket in policy.iter_hf_buckets(bucket_bytes):
        if writer is not None:
            writer.add(bucket)
    if writer is not None and role == "reward_model":
        head = policy.score_weight()
        if head is not None:  # the last stage: the scalar head is the classifier's one-label score layer
            writer.add([(SCORE_WEIGHT, head)])
    return writer.close() if writer is not None else None


def export_peft(policy, out_dir: str | Path, *, dtype: Optional[str] = "auto") -> Optional[Path]:
    """Collective: the policy's LoRA adapters as a PEFT folder at `out_dir` (written by rank 0,
    atomically). Returns the path on rank 0, None elsewhere."""
    adapters = policy.gather_adapters()
    result = None
    if policy.ranks.rank == 0:
        # the frozen base: model.init_from's HF folder when the run started from one (model.hf_dir
        # only shaped it); a base from an mlrl checkpoint has no HF folder: its path is named
        source = getattr(policy, "init_from", None)
        base = _base_hf_dir(policy) or (str(source.path) if source is not None else str(policy.hf_dir))
        result = write_peft_adapter(out_dir, adapters, policy.lora.cfg, base_model=base,
                                    dtype=_export_dtype(policy, dtype))
    dist.barrier()
    return result


def export_hf(policy, out_dir: str | Path, *, max_shard_bytes: int = 2 << 30, bucket_bytes: int = 256 << 20,
              dtype: Optional[str] = "auto", files_from: Optional[str | Path] = None) -> Optional[Path]:
    """Collective: write a complete Hugging Face folder at `out_dir` (shared filesystem across
    ranks). Stage senders write shards into a temporary folder beside `out_dir`; rank 0 merges
    their shard maps, checks the tensor names against config.json, copies config / tokenizer
    files (from `files_from`, default the policy's model.hf_dir) and renames the folder into
    place. Returns the path on rank 0, None elsewhere. `dtype`: "auto" = config.json's dtype,
    None = the parameters' dtype, or "float32" / "bfloat16" / "float16"."""
    out = Path(out_dir)
    tmp = temp_dir_for(out)
    rank = policy.ranks.rank
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    error = None
    try:
        shard_map = export_hf_shards(
            policy, tmp, max_shard_bytes=max_shard_bytes, bucket_bytes=bucket_bytes, dtype=dtype
        )
    except Exception as e:  # reported on every rank below
        shard_map, error = None, f"rank {rank}: {type(e).__name__}: {e}"
    gathered: list[Any] = [None] * policy.ranks.world
    dist.all_gather_object(gathered, (shard_map, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError("HF export failed: " + "; ".join(errors))
    result = None
    if rank == 0:
        out_dtype = _export_dtype(policy, dtype)
        # megatron-bridge's model: its own mapping decides the names
        names = None if via_mbridge(policy) else set(policy.spec.hf_shapes(policy.arch).keys())
        rm = model_role(policy) == "reward_model"
        if rm and names is not None:  # the body's tensors and the score head; no LM head
            names = {n for n in names if not n.startswith("lm_head.")} | {SCORE_WEIGHT}
        result = finalize_hf_folder(
            tmp, out, [m for m, _ in gathered if m], files_from or policy.hf_dir, expected_names=names,
            dtype=str(out_dtype).removeprefix("torch.") if out_dtype is not None else None,
            config_updates=sequence_classifier_config if rm else None)
    dist.barrier()
    return result
