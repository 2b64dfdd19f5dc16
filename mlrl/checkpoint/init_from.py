"""`model.init_from`, the driver's side: a run whose trainer starts from another run's weights (RL
after SFT), checked before any process starts and logged.

The check itself (`check_init_from`, `InitSource`: JSON files only) is mlrl.ckpt_files.init_source,
which the trainer ranks run again (the same verdict) to know which loader to use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mlrl.ckpt_files.init_source import InitSource, check_init_from, read_json
from mlrl.ckpt_files.layout import META_FILE, TRAINER_DIR
from mlrl.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


def check_resume_same_start(resume: Path, hf_dir: Path, source: InitSource | None, *, reference: bool) -> None:
    """Resuming rebuilds what a checkpoint does not hold from the config: a LoRA run's frozen base
    (model.hf_dir, or model.init_from's weights) and the KL reference (`reference`: model.init_from's
    weights, else model.hf_dir's). A config naming another start than the checkpoint's (model.init_from
    left out on the relaunch, or another folder) trained its adapters on another model, or moved the
    KL's reference, silently: refused before any process starts. Checkpoints that predate these
    records are not checked."""
    meta_path = resume / TRAINER_DIR / META_FILE
    if not meta_path.is_file():
        return
    meta = read_json(meta_path)
    lora = bool(meta.get("lora"))
    if lora and meta.get("base_hf_dir"):  # (None: a base from an mlrl checkpoint: init_from below says which)
        if source is None:
            base, shown = hf_dir, str(hf_dir)
        elif source.kind == "hf":
            base, shown = source.weights, str(source.weights)
        else:
            base, shown = None, f"the mlrl checkpoint {source.path}"
        verdict = _same_model(meta["base_hf_dir"], base) if base is not None else False
        if verdict is False:
            raise ConfigError(f"checkpoint.resume: {resume} holds LoRA adapters trained on the base "
                              f"{meta['base_hf_dir']}; this run's base is {shown} (model.hf_dir / model.init_from): "
                              "resume with the same base (the adapters mean nothing on another)")
        if verdict is None:
            log.warning("checkpoint.resume: the base %s the LoRA adapters were trained on is not on this machine "
                        "(moved?): not checked against this run's %s", meta["base_hf_dir"], shown)
    if (lora or reference) and "init_from" in meta:
        saved, now = meta.get("init_from"), str(source.path) if source is not None else None
        verdict = (saved is None) == (now is None) if saved is None or now is None else _same_model(saved, now)
        what = "its LoRA base" if lora else "its KL reference"
        if verdict is False:
            raise ConfigError(f"checkpoint.resume: {resume} was trained with model.init_from={saved}, this run has "
                              f"model.init_from={now}: {what} would be another model; resume with the same "
                              "model.init_from")
        if verdict is None:
            log.warning("checkpoint.resume: model.init_from=%s of the checkpoint is not on this machine (moved?): "
                        "not checked against this run's %s (%s)", saved, now, what)


def _same_model(saved: object, now: object) -> bool | None:
    """True: the same folder, or a copy of it (the same config.json and weight / shard files, by name
    and size); False: another model; None: the saved folder is not here (moved, another machine)."""
    a, b = Path(os.path.realpath(str(saved))), Path(os.path.realpath(str(now)))
    if a == b:
        return True
    if not a.exists():
        return None
    return _fingerprint(a) == _fingerprint(b)


def _fingerprint(folder: Path) -> list[tuple[str, int | str]]:
    if not folder.is_dir():
        return []
    out: list[tuple[str, int | str]] = []
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(folder))
            out.append((rel, p.read_text(errors="replace") if p.name == "config.json" else p.stat().st_size))
    return out


def check_model_init_from(model: ModelConfig, hf_dir: Path, *, resume: Path | None) -> InitSource | None:
    """The driver's check (mlrl.jobs.rl, mlrl.jobs.sft: before any process starts), logged; None when
    model.init_from is off. On resume the checkpoint holds the policy's weights, but init_from is
    still checked: the trainer loads it for the KL reference and, with model.lora, the frozen base."""
    if model.init_from is None:
        return None
    source = check_init_from(model.init_from, read_json(Path(hf_dir) / "config.json"))
    if resume is not None:
        log.info("model.init_from=%s: ignored for the policy's weights (resuming %s, which holds them); it still gives "
                 "the KL reference and the LoRA base", source.path, resume)
    else:
        log.info("model.init_from: the trainer starts from the weights of %s %s (weights only: fresh optimizer, LR "
                 "schedule and data order)", source.what, source.path)
    return source
