"""LoRA adapters as a PEFT folder: adapter_config.json (written by peft's own LoraConfig) and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, folder)` loads and vLLM
serves (`/v1/load_lora_adapter`). Written into a temporary folder and renamed into place, so a
reader never sees half an adapter.

The tensors are peft-named (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
produced by the trainer's `iter_adapters`); their names must cover exactly the adapted modules.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from mlrl.config.schema import LoRAConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(cfg: LoRAConfig, base_model: str):
    """peft's LoraConfig for mlrl's model.lora (same scaling alpha / r, same modules)."""
    from peft import LoraConfig

    # peft annotates lora_alpha as int but scales by any number (alpha / r); the config keeps mlrl's float
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha,  # pyright: ignore[reportArgumentType]
                      lora_dropout=cfg.dropout, target_modules=list(cfg.targets),
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def write_peft_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, *,
                       base_model: str, dtype: torch.dtype | None = None) -> Path:
    """Write `tensors` (peft names) and the adapter config to `folder` atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    modules = {n.split(".")[-3] for n in tensors}
    if not tensors or modules - set(cfg.targets):
        raise ValueError(f"PEFT export: adapter tensors for {sorted(modules)} do not match model.lora.target_modules "
                         f"{list(cfg.targets)}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    peft_config(cfg, base_model).save_pretrained(str(tmp))
    save_file({n: (t.to(dtype) if dtype is not None else t).contiguous() for n, t in tensors.items()},
              str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    return folder
