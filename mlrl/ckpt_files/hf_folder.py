"""Write a Hugging Face model folder from streams of HF-named tensor buckets.

The bridge yields full HF tensors bucket by bucket (never the whole model at once). Two steps:

1. `ShardWriter` (one per writing process, e.g. the sender of each pipeline stage) flushes a
   safetensors file whenever `max_shard_bytes` is reached, so its peak memory is one shard;
   files carry the writer's unique prefix, and `close()` returns its shard map
   {file name: {tensor name: bytes}} (small, JSON-able: it crosses process boundaries).
2. `finalize_hf_folder` (one process) merges the shard maps of all writers, checks that every
   tensor appears exactly once (and, when given, that the set equals what config.json implies),
   renames the files to the usual `model-0000i-of-0000N.safetensors`, writes the index, copies
   config / generation config / tokenizer files and moves the folder into place.

Invariant: the folder appears atomically. Everything is written under a temporary name beside
the target and renamed at the end (a previous export of the same name is moved aside first and
deleted after), so a crash never leaves a half-written export that transformers or vLLM could
pick up. `write_hf_folder` is both steps in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from safetensors.torch import save_file

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
              "added_tokens.json")
INDEX_FILE = "model.safetensors.index.json"

ShardMap = dict[str, dict[str, int]]  # safetensors file name -> {tensor name: bytes}


class ShardWriter:
    """Streams buckets of (HF name, tensor) into `<folder>/<prefix>-00001.safetensors`, ..."""

    def __init__(self, folder: str | Path, prefix: str = "model", *, max_shard_bytes: int = 2 << 30,
                 dtype: Optional[torch.dtype] = None):
        if "/" in prefix or not prefix:
            raise ValueError(f"ShardWriter: prefix {prefix!r} must be a non-empty file-name prefix")
        self.folder, self.prefix, self.max_shard_bytes, self.dtype = Path(folder), prefix, max_shard_bytes, dtype
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shards: ShardMap = {}
        self._current: dict[str, torch.Tensor] = {}
        self._size = 0
        self._seen: set[str] = set()
        self.dtypes: set[str] = set()

    def add(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in bucket:
            if name in self._seen:
                raise ValueError(f"HF export: tensor {name!r} produced twice by the weight stream")
            self._seen.add(name)
            t = t.detach().to("cpu")
            if self.dtype is not None:
                t = t.to(self.dtype)
            self.dtypes.add(str(t.dtype).removeprefix("torch."))
            self._current[name] = t.contiguous()
            self._size += t.numel() * t.element_size()
            if self._size >= self.max_shard_bytes:
                self._flush()

    def _flush(self) -> None:
        fname = f"{self.prefix}-{len(self.shards) + 1:05d}.safetensors"
        save_file(self._current, str(self.folder / fname), metadata={"format": "pt"})
        _readable(self.folder / fname)
        self.shards[fname] = {k: v.numel() * v.element_size() for k, v in self._current.items()}
        self._current, self._size = {}, 0

    def close(self) -> ShardMap:
        """Flush the last shard; returns {file: {tensor: bytes}} of everything written."""
        if self._current:
            self._flush()
        return self.shards


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _readable(path: Path) -> None:
    """safetensors creates files owner-only (0600); give them the usual umask-based mode."""
    os.chmod(path, 0o666 & ~_UMASK)


def temp_dir_for(out_dir: str | Path) -> Path:
    """The temporary folder an export into `out_dir` is written under (same filesystem)."""
    out = Path(out_dir)
    return out.parent / f".{out.name}.tmp"


def finalize_hf_folder(tmp: str | Path, out_dir: str | Path, shard_maps: Iterable[ShardMap], files_from: str | Path, *,
                       expected_names: Optional[Iterable[str]] = None, dtype: Optional[str] = None,
                       config_updates: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None) -> Path:
    """Merge the writers' shard maps (all files already in `tmp`), name the shards, write the
    index, copy the config and tokenizer files from `files_from`, and move `tmp` to `out_dir`.
    `dtype` (e.g. "bfloat16"; None: the one the shards hold), when it differs from config.json's, is
    written into the copied config: transformers and vLLM load with config.json's dtype by default.
    `config_updates(config) -> config` rewrites the copied config.json before the move (a reward
    model's: `sequence_classifier_config`)."""
    tmp, out, src = Path(tmp), Path(out_dir), Path(files_from)
    files: list[tuple[str, dict[str, int]]] = []
    owner: dict[str, str] = {}
    for shard_map in shard_maps:
        for fname in sorted(shard_map):
            if not (tmp / fname).is_file():
                raise FileNotFoundError(f"HF export: shard {fname} is missing from {tmp}")
            for name in shard_map[fname]:
                if name in owner:
                    raise ValueError(f"HF export: tensor {name!r} written twice ({owner[name]} and {fname})")
                owner[name] = fname
            files.append((fname, shard_map[fname]))
    if expected_names is not None:
        expected = set(expected_names)
        missing, extra = sorted(expected - owner.keys()), sorted(owner.keys() - expected)
        if missing or extra:
            raise ValueError(
                f"HF export: the weight stream does not match config.json: "
                f"{len(missing)} missing (first {missing[:1]}), {len(extra)} unexpected (first {extra[:1]})"
            )
    n = len(files)
    if n == 0:  # an empty model: still a valid (empty) single file
        save_file({}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _readable(tmp / "model.safetensors")
    elif n == 1:
        os.replace(tmp / files[0][0], tmp / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, (fname, tensors) in enumerate(files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / fname, tmp / final)
            for k, nbytes in tensors.items():
                weight_map[k] = final
                total += nbytes
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for f in COPY_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    if dtype is None:  # the tensors' own dtype (e.g. fp32 training of a bf16 model, exported as kept)
        dtype = _stored_dtype(tmp)
    if dtype is not None and (tmp / "config.json").is_file():
        cfg = json.loads((tmp / "config.json").read_text())
        if cfg.get("dtype", cfg.get("torch_dtype")) != dtype:
            cfg["dtype"] = dtype
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = dtype
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if config_updates is not None:
        if not (tmp / "config.json").is_file():
            raise FileNotFoundError(f"HF export: {src} has no config.json to derive the exported model's from")
        cfg = config_updates(json.loads((tmp / "config.json").read_text()))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    _move_into_place(tmp, out)
    return out


def sequence_classifier_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A causal LM's config.json -> its one-label `*ForSequenceClassification` (a reward model that
    transformers' AutoModelForSequenceClassification and vLLM's pooling runner load). transformers
    scores the last token that is not pad_token_id, vLLM the last token (mlrl.jobs.rm.strip_pad_tail
    keeps them on one token); a pad id is set (the EOS id) when the model has none."""
    out = dict(cfg)
    archs = [a for a in cfg.get("architectures") or [] if a.endswith("ForCausalLM")]
    if not archs:
        raise ValueError(f"HF export of a reward model: config.json's architectures {cfg.get('architectures')} "
                         "name no *ForCausalLM to derive the *ForSequenceClassification from")
    out["architectures"] = [archs[0].removesuffix("ForCausalLM") + "ForSequenceClassification"]
    out["num_labels"] = 1
    out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    out.pop("problem_type", None)
    out["pad_token_id"] = classifier_pad_id(cfg)
    return out


def classifier_pad_id(cfg: dict[str, Any]) -> Optional[int]:
    """The pad_token_id a reward model's export names: the model's own, else its (first) EOS id."""
    pad = cfg.get("pad_token_id")
    if pad is None:
        eos = cfg.get("eos_token_id")
        pad = eos[0] if isinstance(eos, list) else eos
    return pad


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _stored_dtype(folder: Path) -> Optional[str]:
    """The one floating dtype of the folder's safetensors files (headers only), else None."""
    found: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        found |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    floats = {_SAFETENSORS_DTYPES.get(d, d) for d in found if d.startswith(("F", "BF"))}
    (only,) = floats if len(floats) == 1 else (None,)
    return only if only in _SAFETENSORS_DTYPES.values() else None


def _move_into_place(tmp: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def write_hf_folder(buckets: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str | Path, source_hf_dir: str | Path,
                    *, max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> Path:
    """Single-process export: every bucket of the model through one writer, then finalize."""
    tmp = temp_dir_for(out_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    writer = ShardWriter(tmp, "part", max_shard_bytes=max_shard_bytes, dtype=dtype)
    for bucket in buckets:
        writer.add(bucket)
    return finalize_hf_folder(tmp, out_dir, [writer.close()], source_hf_dir,
                              dtype=str(dtype).removeprefix("torch.") if dtype is not None else None)
