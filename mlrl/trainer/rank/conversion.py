"""Rank side of checkpoint conversion (tools/convert_checkpoint.py): HF folder <-> Megatron
distributed checkpoint, with an optional logits check. A LoRA checkpoint holds only the adapters:
its policy is built on the frozen HF base with the adapters attached, the adapters are loaded
from the checkpoint, and the output is a PEFT adapter folder (optionally also the merged model).

Every function runs on every rank of one torchrun job (a collective, like the policy). Memory
stays bounded by the layout: each rank reads only the HF tensors of its own shard (the bridge's
per-layer loader), dist_checkpointing writes / reads per-rank shards, and the HF export streams
buckets into size-capped safetensors files. Only `--verify` loads the whole HF model into one
process (rank 0, transformers), as any HF-side comparison must.

Outputs appear atomically: the Megatron checkpoint is written under a temporary name and renamed
by rank 0 when every rank has finished; the HF export does the same (mlrl.ckpt_files.hf_folder),
and so does the PEFT adapter folder (mlrl.ckpt_files.peft_adapter).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, cast

import torch
import torch.distributed as dist

from mlrl.ckpt_files.errors import CheckpointError
from mlrl.config.schema import PRECISION, Dtype
from mlrl.trainer.rank import dist_ckpt as ckpt
from mlrl.trainer.rank.hf_export import export_hf, export_peft

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


def world_size_for(tp: int, pp: int, ep: int, etp: Optional[int] = None, cp: int = 1) -> int:
    """The smallest world for a layout: tp*pp*cp*dp where dp makes room for the expert groups
    (Megatron carves ep*etp out of tp*cp*dp)."""
    etp = etp or tp
    dp = (etp * ep) // math.gcd(tp * cp, etp * ep)
    return tp * pp * cp * dp


def conversion_config(hf_dir: str | Path, *, tp: int, pp: int, ep: int, model_dtype: str, bridge: str = "auto"):
    """(Config, Layout) of a conversion job: a frozen policy in `model_dtype` (float32 / bfloat16 /
    float16), `world_size_for` ranks, through `bridge` (model.bridge)."""
    from mlrl.config.schema import Config
    from mlrl.config.validate import resolve_layout

    cfg = Config()
    cfg.model.hf_dir = str(hf_dir)
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = tp, pp, ep
    # inside a job started by someone else (torchrun over several nodes) its world is the layout's
    world = int(os.environ.get("WORLD_SIZE") or world_size_for(tp, pp, ep))
    if world % (tp * pp):
        raise CheckpointError(f"conversion: tp*pp = {tp}*{pp} does not divide the job's {world} ranks")
    cfg.cluster.trainer_devices = world  # dp = world / (tp*pp)
    # megatron-core's MoE layer refuses TP without sequence parallelism
    cfg.parallel.sequence_parallel = tp > 1 and bool(hf.get("num_experts") or hf.get("num_local_experts"))
    cfg.model.dtype = cast(Dtype, model_dtype)
    cfg.model.bridge = cast(Literal["auto", "builtin", "megatron-bridge"], bridge)
    return cfg, resolve_layout(cfg)


@contextlib.contextmanager
def _without_hf_weights() -> Iterator[None]:
    """MegatronPolicy reads and checks the HF safetensors while it builds; a policy whose weights
    come from a Megatron checkpoint has only config.json. Until MegatronPolicy takes an option
    to skip its HF load, these two steps are no-ops for the duration of the build (the
    parameters are then uninitialised and MUST be loaded next)."""
    from mlrl.trainer.rank import policy as policy_module
    from mlrl.trainer.rank.weights import LocalParams

    class _ConfigOnly:
        def __init__(self, hf_dir: str | Path):
            self.dir = Path(hf_dir)

        def check(self, spec, arch, *, score_head: bool = False) -> None:
            pass

    from mlrl.trainer.rank.mbridge import MBridgeParams

    saved = policy_module.HFCheckpoint, LocalParams.load_hf, MBridgeParams.load_initial
    policy_module.HFCheckpoint = _ConfigOnly
    LocalParams.load_hf = lambda self, ckpt: None
    MBridgeParams.load_initial = lambda self: None
    try:
        yield
    finally:
        policy_module.HFCheckpoint, LocalParams.load_hf, MBridgeParams.load_initial = saved


def policy_from_checkpoint(path: str | Path, cfg, layout, *, trainable: bool = False):
    """A policy (or a reward model: the checkpoint's role) built from the checkpoint's own config
    files, then loaded from it (weights only)."""
    from mlrl.trainer.rank.policy import MegatronPolicy
    from mlrl.trainer.rank.reward_model import MegatronRewardModel

    path = Path(path)
    role = ckpt.read_meta(path).get("role", "policy")
    model_class = MegatronRewardModel if role == "reward_model" else MegatronPolicy
    with _without_hf_weights():
        policy = model_class(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=path / ckpt.HF_FILES_DIR,
                             trainable=trainable)
    ckpt.load_checkpoint(policy, path, load_optimizer=False)
    return policy


def _rank() -> int:
    return dist.get_rank()


def _move_into_place(tmp: Path, out: Path) -> None:
    if _rank() == 0:
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    dist.barrier()


def hf_to_mcore(hf_dir: str | Path, out: str | Path, *, tp: int, pp: int, ep: int, dtype: str, verify: bool,
                bridge: str = "auto", progress: Progress = _noop) -> dict[str, Any]:
    from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

    out = Path(out)
    cfg, layout = conversion_config(hf_dir, tp=tp, pp=pp, ep=ep, model_dtype=dtype, bridge=bridge)
    init_parallel(cfg.parallel, layout, seed=cfg.trainer.seed)
    t0 = time.perf_counter()
    progress("reading HF weights into the sharded model")
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=hf_dir, trainable=False)
    t1 = time.perf_counter()
    progress("writing the Megatron checkpoint")
    tmp = out.parent / f".{out.name}.tmp"
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    ckpt.save_checkpoint(policy, tmp)
    _move_into_place(tmp, out)
    t2 = time.perf_counter()
    report: dict[str, Any] = {"read_s": t1 - t0, "save_s": t2 - t1, "world": layout.trainer_devices}
    if verify:
        progress("verifying logits against transformers")
        report["max_abs_logit_diff"] = logits_gap(policy, hf_dir)
    return report


def lora_policy_from_checkpoint(path: str | Path, base: str | Path, cfg, layout, lora: dict[str, Any]):
    """A frozen policy on the HF base `base` with the LoRA checkpoint's adapters (`lora`: the
    checkpoint's "lora" record, rank / alpha / targets) attached and loaded."""
    from mlrl.config.schema import LoRAConfig
    from mlrl.trainer.rank.policy import MegatronPolicy

    cfg.model.lora = LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], target_modules=list(lora["targets"]),
                                dropout=lora.get("dropout", 0.0), init=lora.get("init", "kaiming"))
    policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, layout, hf_dir=base, trainable=False)
    ckpt.load_checkpoint(policy, path, load_optimizer=False)
    return policy


def mcore_to_hf(path: str | Path, out: str | Path, *, tp: int, pp: int, ep: int, dtype: Optional[str],
                max_shard_bytes: int, verify: bool, base: Optional[str | Path] = None,
                merged_out: Optional[str | Path] = None, bridge: str = "builtin",
                progress: Progress = _noop) -> dict[str, Any]:
    """Full checkpoint: the HF model at `out`. LoRA checkpoint (built on the HF folder `base`): the
    PEFT adapter folder at `out`, and the merged model (W + alpha/r B A) at `merged_out` if given."""
    from mlrl.trainer.rank.policy import init_parallel

    path, out = Path(path), Path(out)
    meta = ckpt.read_meta(path)
    lora = meta.get("lora")
    hf_dir: str | Path = path / ckpt.HF_FILES_DIR  # the HF folder the policy is built on (LoRA: the base)
    if lora:
        if base is None:
            raise CheckpointError(f"checkpoint {path}: a LoRA checkpoint (adapters only) needs its HF base")
        hf_dir = base
    saved = meta["optimizer"]["precision"]  # the model.dtype it was saved in, as the trainer's precision name
    cfg, layout = conversion_config(hf_dir, tp=tp, pp=pp, ep=ep,
                                    model_dtype=next(d for d, p in PRECISION.items() if p == saved), bridge=bridge)
    init_parallel(cfg.parallel, layout, seed=cfg.trainer.seed)
    t0 = time.perf_counter()
    progress("loading the Megatron checkpoint")
    policy = lora_policy_from_checkpoint(path, hf_dir, cfg, layout, lora) if lora else \
        policy_from_checkpoint(path, cfg, layout)
    t1 = time.perf_counter()
    if lora:
        progress("writing the PEFT adapter")
        export_peft(policy, out, dtype=dtype)
    hf_out = merged_out if lora else out  # LoRA: the merged model only when asked for
    if hf_out is not None:
        progress("writing HF safetensors")
        export_hf(policy, hf_out, max_shard_bytes=max_shard_bytes, dtype=dtype,
                  files_from=path / ckpt.HF_FILES_DIR)
    t2 = time.perf_counter()
    report: dict[str, Any] = {"load_s": t1 - t0, "export_s": t2 - t1, "world": layout.trainer_devices}
    if verify and ckpt.model_role(policy) == "reward_model":
        progress("verifying scores against transformers")
        report["max_abs_score_diff"] = scores_gap(policy, out)
    elif verify:
        progress("verifying logits against transformers")
        # LoRA: peft's adapter on the transformers base; the merged folder in transformers alone
        report["max_abs_logit_diff"] = logits_gap(policy, hf_dir, adapter=out) if lora else logits_gap(policy, out)
        if lora and merged_out is not None:
            report["merged_max_abs_logit_diff"] = logits_gap(policy, merged_out)
    return report


def probe_micro_batch(vocab_size: int, *, n_samples: int = 2, length: int = 24, seed: int = 0):
    """A packed micro-batch of seeded random token rows (no loss: only logits are compared)."""
    from mlrl.experience.batch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab_size, (length,), generator=g) for _ in range(n_samples)]
    S = length * n_samples
    zeros = torch.zeros(S)
    return MicroBatch(tokens=torch.cat(rows), position_ids=torch.arange(length).repeat(n_samples),
                      cu_seqlens=torch.arange(0, S + 1, length, dtype=torch.int32),
                      sample_ids=torch.arange(n_samples).repeat_interleave(length), loss_mask=zeros,
                      loss_weight=zeros.clone(), advantages=zeros.clone(), rollout_logprobs=zeros.clone())


def logits_gap(policy, hf_dir: str | Path, *, adapter: Optional[str | Path] = None, **probe: Any) -> float:
    """max |logit(policy) - logit(transformers on hf_dir)| over a probe batch; with `adapter` (a
    PEFT folder) the HF model is peft's PeftModel of it on hf_dir. Collective; rank 0 loads the HF
    model, the value is broadcast to every rank."""
    mb = probe_micro_batch(policy.arch.vocab_size, **probe)
    logits = policy.compute_logits([mb])[0]
    gap = torch.zeros(1, dtype=torch.float64)
    if _rank() == 0:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).eval()
        cu = mb.cu_seqlens.tolist()
        with torch.no_grad():
            for a, b in zip(cu[:-1], cu[1:]):
                ref = model(mb.tokens[a:b][None]).logits[0].float()
                gap = torch.maximum(gap, (logits[a:b] - ref).abs().max().double().reshape(1))
        del model
    dist.broadcast(gap, src=0)
    return float(gap)


def scores_gap(model, hf_dir: str | Path, **probe: Any) -> float:
    """A reward model's max |score(Megatron) - score(transformers' *ForSequenceClassification on
    hf_dir)| over the probe batch's sequences (each scored at its last token). Collective, as
    logits_gap."""
    from mlrl.algorithms.rm_loss import sequence_scores

    mb = probe_micro_batch(model.arch.vocab_size, **probe)
    ours = sequence_scores(mb, model.compute_scores([mb])[0])
    gap = torch.zeros(1, dtype=torch.float64)
    if _rank() == 0:
        import transformers

        hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        cu = mb.cu_seqlens.tolist()
        with torch.no_grad():
            ref = torch.stack([hf(mb.tokens[a:b][None]).logits[0, 0].float() for a, b in zip(cu[:-1], cu[1:])])
        gap = (ours - ref).abs().max().double().reshape(1)
        del hf
    dist.broadcast(gap, src=0)
    return float(gap)


def check_output_dir(out: str | Path, *, force: bool, flag: str = "--out") -> None:
    """An output folder must not hold anything unless --force (it is replaced atomically then)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{flag} {out}: exists and is not empty (pass --force to replace it)")
