"""Reading a Hugging Face safetensors checkpoint: validate it whole, then read only some tensors.

`HFCheckpoint(hf_dir)` parses the headers of every shard (a few KB each, no tensor data), so
a missing shard, a truncated file or a header that lies about its data fails at once with the
file named. `check(spec, arch)` compares the tensor names and shapes with what config.json
implies, naming the first offending tensor, before any model is built. `read(names)` then
loads just the listed tensors (each rank asks only for what its shard of the model needs).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from mlrl.bridge.arch import SCORE_WEIGHT, BridgeError, ModelArch
from mlrl.bridge.specs import ArchSpec

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _read_header(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise BridgeError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise BridgeError(f"{path}: truncated safetensors file (header of {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BridgeError(f"{path}: corrupt safetensors header ({e})") from None
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + data_end > size:
        raise BridgeError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + data_end})")
    for k, v in header.items():
        if k == "__metadata__":
            continue
        lo, hi = v["data_offsets"]
        numel = 1
        for d in v["shape"]:
            numel *= d
        if hi - lo != numel * _DTYPE_BYTES.get(v["dtype"], 0) and v["dtype"] in _DTYPE_BYTES:
            raise BridgeError(
                f"{path}: tensor {k!r} has {hi - lo} bytes, shape {v['shape']} {v['dtype']} needs "
                f"{numel * _DTYPE_BYTES[v['dtype']]}"
            )
    return header


class HFCheckpoint:
    """The tensors of an HF model folder (model.safetensors or a sharded index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.tensors: dict[str, TensorInfo] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise BridgeError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").is_file():
            # as transformers: without an index the weights are model.safetensors, whatever else is
            # beside it (Mistral's consolidated.safetensors, an adapter, an EMA copy)
            files, weight_map = ["model.safetensors"], None
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise BridgeError(
                f"{self.dir}: no *.safetensors weights found (expected model.safetensors or "
                "model.safetensors.index.json)"
            )
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise BridgeError(f"{path}: safetensors shard listed in the index is missing")
            for key, v in _read_header(path).items():
                if key == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(key) != name:
                    continue
                if key in self.tensors:  # files without an index, two holding one name: which one is meant?
                    raise BridgeError(f"{self.dir}: tensor {key!r} is in both {self.tensors[key].file.name} and "
                                      f"{name}, and no model.safetensors.index.json says which")
                self.tensors[key] = TensorInfo(path, tuple(v["shape"]), v["dtype"])
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self.tensors)
            if missing:
                raise BridgeError(
                    f"{self.dir}: tensor {missing[0]!r} is listed in the index but absent from {weight_map[missing[0]]}"
                )

    def check(self, spec: ArchSpec, arch: ModelArch, *, score_head: bool = False) -> None:
        """Every tensor config.json implies is present with its shape, and nothing unknown is.
        `score_head`: a one-label `*ForSequenceClassification` folder (a reward model): `score.weight`
        [1, hidden] instead of an LM head."""
        expected = spec.hf_shapes(arch)
        if score_head:
            expected = {k: v for k, v in expected.items() if not k.startswith("lm_head.")}
            expected[SCORE_WEIGHT] = (1, arch.hidden_size)
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is None:
                raise BridgeError(
                    f"{self.dir}: tensor {name!r} is missing (config.json: model_type={arch.model_type!r}, "
                    f"{arch.num_layers} layers{f', {arch.num_experts} experts' if arch.is_moe else ''})"
                )
            if info.shape != shape:
                raise BridgeError(
                    f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(shape)}"
                )
        extra = sorted(n for n in self.tensors if n not in expected and not spec.ignorable_hf_tensor(arch, n))
        if extra:
            raise BridgeError(f"{self.dir}: tensor {extra[0]!r} is not part of the model config.json describes "
                              f"({len(extra)} unexpected tensor(s))")

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Load only `names` (grouped by file)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.tensors:
                raise BridgeError(f"{self.dir}: tensor {n!r} is missing")
            by_file.setdefault(self.tensors[n].file, []).append(n)
        out: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for k in keys:
                        t = f.get_tensor(k)
                        out[k] = t.to(dtype) if dtype is not None else t
            except Exception as e:  # safetensors raises its own error types
                raise BridgeError(f"{path}: cannot read tensors ({e})") from None
        return out
