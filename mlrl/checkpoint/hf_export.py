"""Write a Hugging Face model folder from a stream of HF-named tensor buckets.

The bridge yields full HF tensors bucket by bucket (never the whole model at once); this writer
flushes a safetensors shard whenever `max_shard_bytes` is reached, so peak memory is one shard.
Config, generation config and tokenizer files are copied from the source HF folder. The folder
appears atomically (written under a temporary name, renamed at the end), so a crash never leaves
a half-written export that transformers or vLLM could pick up.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


def write_hf_folder(buckets: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str | Path, source_hf_dir: str | Path,
                    *, max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> Path:
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict[str, int]] = []  # per flushed shard: name -> bytes (tensors are not kept)
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[str] = set()
    for bucket in buckets:
        for name, t in bucket:
            if name in seen:
                raise ValueError(f"HF export: tensor {name!r} produced twice by the weight stream")
            seen.add(name)
            t = t.detach().to("cpu")
            if dtype is not None:
                t = t.to(dtype)
            current[name] = t.contiguous()
            size += t.numel() * t.element_size()
            if size >= max_shard_bytes:
                shards.append(_flush(tmp, len(shards) + 1, current))
                current, size = {}, 0
    if current or not shards:
        shards.append(_flush(tmp, len(shards) + 1, current))
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    if n == 1:
        os.replace(tmp / "shard-1.safetensors", tmp / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, (fname, shard) in enumerate(zip(names, shards), start=1):
            os.replace(tmp / f"shard-{i}.safetensors", tmp / fname)
            for k, nbytes in shard.items():
                weight_map[k] = fname
                total += nbytes
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    src = Path(source_hf_dir)
    for f in COPY_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    if dtype is not None and (tmp / "config.json").is_file():
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _flush(folder: Path, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    save_file(tensors, str(folder / f"shard-{index}.safetensors"), metadata={"format": "pt"})
    return {k: v.numel() * v.element_size() for k, v in tensors.items()}
