"""Resumable distributed checkpoints of a `MegatronPolicy` (or a `MegatronCritic`, the same
format). The policy's streamed Hugging Face / PEFT export is mlrl.trainer.rank.hf_export.

Rank side (every function is a collective over all trainer ranks, like the policy's methods):

    save_checkpoint(policy, path, *, async_save=False)    model + optimizer + scheduler + RNG
    load_checkpoint(policy, path) -> dict                 checks first, then loads in place
    load_model_weights(policy, path)                      the weights only (model.init_from), any saved layout
    init_weights_from(policy, spec) -> InitSource         model.init_from: a checkpoint or an HF folder
    finalize_async_saves(blocking=True) -> int            completes pending async saves (GPU)
    close_async_saves()                                   stops the background writer (at shutdown)

Format: Megatron-Core `dist_checkpointing` (torch_dist) in `path/`, plus two things of ours
written by rank 0 after every rank has finished writing: `hf_files/` (config.json,
generation_config.json, tokenizer files: enough to export an HF folder from the checkpoint
alone) and `mlrl_checkpoint.json` (format version, the role: policy or critic, the HF config,
the architecture the bridge parsed from it, the parallel layout, the optimizer kind / precision
(fp32 / bf16 / fp16, derived from model.dtype) / state sharding, the optimizer step count).
`mlrl_checkpoint.json` is written last: a directory without it was never completely written.

Invariants:
- Nothing is loaded before everything that can be checked has been: the directory is complete,
  it holds the same role (a policy's checkpoint never loads into a critic, nor the reverse: their
  output layers differ), the architecture equals the model's (every field of `ModelArch`), and the
  optimizer state can be resharded into this layout. Errors are `CheckpointError`s naming the
  field and both values.
- Resharding: model tensors are Megatron ShardedTensors (TP / PP / VPP / EP / DP changes load).
  The DistributedOptimizer state is saved as `fully_reshardable` (model-space tensors; TP / PP /
  DP / EP changes load); a checkpoint written with `dp_reshardable` (Megatron-LM's default)
  loads only under the same model-parallel layout, which is checked. Megatron splits the
  optimizer into a chain (dense / expert-parallel parts) whose length can change with EP: the
  saved param groups are given to every current part. A plain (non-distributed) optimizer's
  state is in Megatron's model-space format too; switching between the distributed and the
  plain optimizer is refused (their optimizer states are keyed differently).
- Exact resume: the optimizer state is saved only once it exists (after the first step; before
  it, a fresh optimizer is the same state). Every rank's RNG states (python, numpy, torch CPU,
  CUDA, Megatron's tensor-parallel tracker) are a ShardedObject per global rank, restored when
  the layout is unchanged (a different layout has different ranks: they are then reported as not
  restored, as Megatron-LM does). The scheduler position comes from the checkpoint; its
  hyper-parameters (lr, warm-up, decay) from the running config, so a resumed run follows the
  config it was resumed with (differences are reported).
- megatron-core 0.16.1 with torch's Adam (no Apex / TE) needs three repairs on load, each
  commented where it is made: dummy optimizer state before the load, `step` set aside while the
  DistributedOptimizer copies parameter state, and one `step` tensor per parameter afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, cast

import numpy as np
import torch
import torch.distributed as dist

from mlrl.bridge import spec_for
from mlrl.ckpt_files.errors import CheckpointError
from mlrl.ckpt_files.hf_folder import COPY_FILES
from mlrl.ckpt_files.init_source import check_init_from
from mlrl.ckpt_files.layout import FORMAT, MEGATRON_FILES, META_FILE
from mlrl.config.schema import PRECISION

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

log = logging.getLogger(__name__)

HF_FILES_DIR = "hf_files"
DEFAULT_OPTIM_SHARDING = "fully_reshardable"
_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
_RNG_KEY = "mlrl.rng_state"
_ASYNC_QUEUE: Any = None


# ---- metadata ------------------------------------------------------------------------------------
def _layout(policy) -> dict[str, Any]:
    r = policy.ranks
    return {"tp": r.tp_size, "pp": r.pp_size, "cp": r.cp_size, "ep": r.ep_size, "etp": r.etp_size, "dp": r.dp_size,
            "vpp": policy.config.virtual_pipeline_model_parallel_size, "world": r.world,
            "pp_layer_split": list(policy.parallel.pp_layer_split) if policy.parallel.pp_layer_split else None}


def _sharding_metadata(sharding_type: str) -> dict[str, Any]:
    """What Megatron's sharded_state_dict methods are told (the same on save and load)."""
    return {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}


def _optimizer_kind(policy) -> dict[str, Any]:
    t, precision = policy.trainer_cfg, policy.model_cfg.precision  # precision: derived from model.dtype
    return {"type": t.optimizer, "distributed": bool(t.use_distributed_optimizer), "precision": precision}


def _shown(key: str, value: Any) -> Any:
    """A recorded optimizer setting as the config names it (precision 'bf16' -> model.dtype 'bfloat16')."""
    if key == "precision":
        return next((d for d, p in PRECISION.items() if p == value), value)
    return value


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's `mlrl_checkpoint.json`, after checking that the directory is complete."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p}: does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p}: not a directory")
    meta_file = p / META_FILE
    if not meta_file.is_file():
        if (p / "model_optim" / META_FILE).is_file():
            raise CheckpointError(f"checkpoint {p}: pass the checkpoint's model_optim/ folder ({p / 'model_optim'}), "
                                  "or resolve a run's checkpoint root with CheckpointManager.resolve_resume")
        what = "an interrupted save (Megatron shards without" if any(p.iterdir()) else "empty (no"
        raise CheckpointError(f"checkpoint {p}: incomplete, {what} {META_FILE}); use an earlier checkpoint")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {meta_file}: unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {meta_file}: format {meta.get('format')!r}, this mlrl reads {FORMAT!r}")
    for f in MEGATRON_FILES:  # written by megatron-core's finalize step, after every shard
        if not (p / f).is_file():
            raise CheckpointError(f"checkpoint {p}: incomplete, Megatron's {f} is missing")
    return meta


def _arch_differences(saved_hf_config: dict, policy) -> list[str]:
    if via_mbridge(policy):  # megatron-bridge's model: the HF configs themselves are compared
        mine = policy.hf_config
        return [f"{k}: checkpoint {saved_hf_config.get(k)!r}, model {mine.get(k)!r}"
                for k in sorted(set(saved_hf_config) | set(mine))
                if k not in _HF_BOOKKEEPING and saved_hf_config.get(k) != mine.get(k)]
    try:
        _, saved = spec_for(saved_hf_config)
    except Exception as e:  # any parse failure is a mismatch worth naming
        return [f"the checkpoint's config.json cannot be parsed ({e})"]
    a, b = asdict(saved), asdict(policy.arch)
    return [f"{k}: checkpoint {a[k]!r}, model {b.get(k)!r}" for k in a if a[k] != b.get(k)]


def via_mbridge(policy) -> bool:
    """The policy was built by megatron-bridge (model.bridge; mlrl.trainer.rank.mbridge)."""
    return getattr(policy, "mbridge", None) is not None


# config.json keys that say nothing about the architecture (who wrote it, its dtype on disk)
_HF_BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures"})


def model_role(policy) -> str:
    """The role, "policy" (an LM head) or "critic" (a value head): recorded in checkpoints, checked by HF export."""
    return getattr(policy, "role", "policy")


def _check_role(policy, meta: dict[str, Any]) -> None:
    saved_role = meta.get("role", "policy")  # checkpoints written before roles were recorded are policies
    if saved_role != model_role(policy):
        raise CheckpointError(f"checkpoint holds a {saved_role} (its output layer: "
                              f"{'the LM head' if saved_role == 'policy' else 'a value head'}), the model being loaded "
                              f"is a {model_role(policy)}: load a {model_role(policy)} checkpoint into it")


def _check_arch(policy, meta: dict[str, Any]) -> None:
    diff = _arch_differences(meta["hf_config"], policy)
    if diff:
        raise CheckpointError(
            f"checkpoint architecture does not match model.hf_dir={policy.hf_dir}: " + "; ".join(diff)
        )


def check_loadable(policy, meta: dict[str, Any], *, load_optimizer: bool) -> None:
    """Everything that would make the load fail or be wrong, checked before any tensor moves."""
    _check_role(policy, meta)
    saved_lora, lora = meta.get("lora"), _lora_meta(policy)
    # what the adapters ARE (dropout and init only shaped their training)
    saved_lora, lora = ({k: m[k] for k in ("rank", "alpha", "targets")} if m is not None else None
                        for m in (saved_lora, lora))
    if saved_lora != lora:
        def shown(m):
            return "no LoRA (full weights)" if m is None else \
                f"LoRA rank {m['rank']} alpha {m['alpha']} on {', '.join(m['targets'])}"
        raise CheckpointError(f"checkpoint holds {shown(saved_lora)}, this run has {shown(lora)} (model.lora): "
                              "resume with the same model.lora settings")
    _check_arch(policy, meta)
    if not load_optimizer:
        return
    saved, now = meta["optimizer"], _optimizer_kind(policy)
    for key, field in (("type", "trainer.optimizer"), ("precision", "model.dtype"),
                       ("distributed", "trainer.use_distributed_optimizer")):
        if saved[key] != now[key]:
            raise CheckpointError(f"checkpoint optimizer state was saved with {field}={_shown(key, saved[key])!r}, "
                                  f"this run has {_shown(key, now[key])!r}: use the same setting to resume (or load "
                                  "the weights only)")
    sharding = saved["sharding"]["distrib_optim_sharding_type"]
    parts = len(_inner_optimizers(policy.optimizer))
    if saved.get("parts", parts) != parts and not (saved["distributed"] and sharding in _RESHARDABLE):
        raise CheckpointError(
            f"checkpoint optimizer has {saved['parts']} part(s) (dense / expert-parallel), this layout "
            f"{parts}: only a distributed optimizer saved as {_RESHARDABLE[0]!r} reshards across that "
            f"change; resume with ep={meta['layout']['ep']}"
        )
    if saved["distributed"] and sharding not in _RESHARDABLE:
        old, new = meta["layout"], _layout(policy)
        keys = ("tp", "pp", "cp", "ep", "etp", "vpp", "pp_layer_split")
        changed = [f"{k} {old[k]} -> {new[k]}" for k in keys if old[k] != new[k]]
        if changed:
            raise CheckpointError(
                f"checkpoint optimizer state is {sharding!r} (reshardable along DP only) and cannot be "
                f"loaded after a model-parallel layout change ({', '.join(changed)}): resume with "
                f"tp={old['tp']} pp={old['pp']} ep={old['ep']} cp={old['cp']}"
            )


# ---- RNG -----------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert tracker is not None  # the call initializes it
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert tracker is not None  # the call initializes it
    tracker.set_states(state["tracker"])


# ---- sharded state dict ----------------------------------------------------------------------------
def _unwrapped(policy) -> list[MegatronModule]:
    """The GPTModel chunks: keys must not depend on the DDP wrapper (a frozen policy has none)."""
    out = []
    for chunk in policy.model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        out.append(chunk)
    return out


def _model_state(policy, sharding: dict[str, Any]) -> dict[str, Any]:
    """Megatron's sharded state dict of every chunk; with LoRA only the adapters (the frozen base
    is the model.hf_dir it was built from, and the checkpoint records that)."""
    chunks = _unwrapped(policy)
    keys = _model_keys(policy)
    out = {k: m.sharded_state_dict(metadata=dict(sharding)) for k, m in zip(keys, chunks)}
    if _lora(policy) is not None:
        out = {k: {n: t for n, t in sd.items() if _is_adapter(n)} for k, sd in out.items()}
    return out


def _lora(policy):
    return getattr(policy, "lora", None)


def _is_adapter(name: str) -> bool:
    from mlrl.trainer.rank.lora import PREFIX

    return f".{PREFIX}" in name


def _lora_meta(policy) -> Optional[dict[str, Any]]:
    lora = _lora(policy)
    return None if lora is None else {"rank": lora.cfg.rank, "alpha": lora.cfg.alpha,
                                      "targets": list(lora.cfg.targets), "dropout": lora.cfg.dropout,
                                      "init": lora.cfg.init}


def _base_hf_dir(policy) -> Optional[str]:
    """The HF folder of a LoRA policy's frozen base: model.hf_dir, or model.init_from when that is
    an HF folder (None when the base came from an mlrl checkpoint: no HF folder holds it)."""
    source = getattr(policy, "init_from", None)
    if source is None:
        return str(policy.hf_dir)
    return str(source.weights) if source.kind == "hf" else None


def lora_meta_base(meta: dict[str, Any]) -> Optional[str]:
    """The HF folder a LoRA checkpoint's frozen base was built from (None: not a LoRA checkpoint)."""
    return meta.get("base_hf_dir") if meta.get("lora") else None


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _prepare_optimizer_for_load(optimizer) -> None:
    """Without Apex / Transformer Engine, megatron-core's DistributedOptimizer builds its (load)
    state dict from the optimizer's current state, which torch's Adam creates lazily at the first
    step (`state_dict()` asserts on one common `step`): give it dummy state first (the load
    replaces it; the weights the dummy step moves are loaded too). The plain optimizers do this
    themselves (init_state_fn), and Apex / TE optimizers need nothing."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    for opt in _inner_optimizers(optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            from mlrl.trainer.rank import cpu_compat

            with cpu_compat.cuda_tensor_methods():
                opt._init_optimizer_states_with_dummy_values()


_PARAM_STATE_LOADERS = {
    "fully_reshardable": "load_parameter_state_from_fully_reshardable",
    "dp_reshardable": "load_parameter_state_from_dp_reshardable",
    "fully_sharded_model_space": "load_parameter_state_from_fs_model_space",
    "dp_zero_gather_scatter": "load_parameter_state_from_dp_zero",
}


def _per_optimizer_states(state: Any, n: int) -> list[dict[str, Any]]:
    """Megatron splits the optimizer by parameter kind (dense / expert-parallel) into a chain
    whose length depends on the layout (an EP change can turn two parts into one). The loaded
    state then mixes two structures: the common part (param groups, sharding type) as saved,
    the tensors as requested now. Give each current part all saved param groups (the
    DistributedOptimizer picks its own by their identifying keys) and its own tensors."""
    def parts(d: dict) -> list[dict]:
        keys = sorted(k for k in d if isinstance(k, int))
        return [d[k] for k in keys] if keys else [d]

    current = parts(state) if n > 1 else [state]
    saved = parts(state)
    if len(saved) == n:
        return saved if n > 1 else [state]
    groups = [g for part in saved if "optimizer" in part for g in part["optimizer"]["param_groups"]]
    common = {k: v for part in saved for k, v in part.items() if k not in ("optimizer", "param_state")}
    return [{**common, "optimizer": {"param_groups": [dict(g) for g in groups]}, "param_state": cur["param_state"]}
            for cur in current]


def _load_optimizer_state(optimizer, state: Any) -> None:
    """`optimizer.load_state_dict`, except that a DistributedOptimizer's parameter state is
    loaded with torch Adam's per-parameter `step` set aside: megatron-core copies every state
    entry of the destination from the loaded tensors, and `step` is not among them (it is
    restored from the param groups, before) -> KeyError('step') without Apex / TE."""
    inner = _inner_optimizers(optimizer)
    for opt, sd in zip(inner, _per_optimizer_states(state, len(inner))):
        loader = getattr(opt, _PARAM_STATE_LOADERS.get(sd.get("param_state_sharding_type", ""), ""), None)
        if loader is None:  # a plain optimizer (or an unknown format): Megatron's own path
            opt.load_state_dict(sd)
            continue
        param_state = sd.pop("param_state")
        sd.pop("param_state_sharding_type")
        opt.load_state_dict(sd)
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        try:
            loader(param_state)
        finally:
            for p, step in steps.items():
                opt.optimizer.state[p]["step"] = step
    if len(inner) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


def _fix_step_state(optimizer, steps: int) -> None:
    """torch Adam keeps a per-parameter `step` tensor and increments it in place. megatron-core's
    DistributedOptimizer.load_state_dict gives every parameter the SAME step tensor (so one
    optimizer step would advance it once per parameter and corrupt bias correction), and the
    plain optimizers restore it only when one was saved: give each parameter its own."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            continue
        for st in inner.state.values():
            if "step" in st:
                st["step"] = st["step"].detach().clone() if torch.is_tensor(st["step"]) else st["step"]
            elif "exp_avg" in st:
                st["step"] = torch.tensor(float(steps))


def _state_dict(policy, *, sharding: dict[str, Any], optimizer: bool, rng: bool, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = _model_state(policy, sharding)
    if optimizer:
        if is_loading:
            _prepare_optimizer_for_load(policy.optimizer)
        sd["optimizer"] = policy.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=dict(sharding))
        sd["scheduler"] = policy.scheduler.state_dict()
    if rng:
        r = policy.ranks
        sd["rng_state"] = ShardedObject(_RNG_KEY, _rng_state(), (r.world,), (r.rank,), replica_id=0)
    return sd


# ---- save ----------------------------------------------------------------------------------------
def save_checkpoint(policy, path: str | Path, *, async_save: bool = False,
                    optim_sharding: str = DEFAULT_OPTIM_SHARDING) -> None:
    """Save the policy's training state into `path` (created; should be empty). Collective.
    With `async_save` on GPU the shards are written in the background and the checkpoint is
    complete only after `finalize_async_saves()` has run on every rank."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    path = Path(path)
    if policy.ranks.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        # a save into a used folder must not look complete before it is
        (path / META_FILE).unlink(missing_ok=True)
    dist.barrier()
    trainable = policy.optimizer is not None
    with_optimizer = trainable and policy.optimizer_steps > 0
    sharding = _sharding_metadata(optim_sharding)
    from mlrl.trainer.rank import cpu_compat

    with cpu_compat.cuda_tensor_methods():  # the DistributedOptimizer gathers its state with .cuda() tensors
        sd = _state_dict(policy, sharding=sharding, optimizer=with_optimizer, rng=trainable, is_loading=False)
    if trainable and not with_optimizer:
        sd["scheduler"] = policy.scheduler.state_dict()
    meta = {
        "format": FORMAT, "backend": "torch_dist", "megatron_core": _megatron_version(), "role": model_role(policy),
        "model_type": policy.arch.model_type, "arch": asdict(policy.arch), "hf_config": policy.hf_config,
        # which converter built the model: its parameter names (the TE spec of megatron-bridge's
        # provider vs mlrl's) are what the shards are keyed by, so a reader must build the same
        "bridge": "megatron-bridge" if via_mbridge(policy) else "builtin",
        "layout": _layout(policy),
        # a LoRA checkpoint holds only the adapters: the base is this HF folder
        "lora": _lora_meta(policy), "base_hf_dir": _base_hf_dir(policy) if _lora(policy) is not None else None,
        "init_from": str(policy.init_from.path) if getattr(policy, "init_from", None) else None,
        "contents": {"model": True, "optimizer": with_optimizer, "scheduler": trainable, "rng": trainable},
        "optimizer": {**_optimizer_kind(policy), "sharding": sharding, "steps": int(policy.optimizer_steps),
                      "parts": len(_inner_optimizers(policy.optimizer)) if trainable else 0},
    }
    strategy = FullyParallelSaveStrategyWrapper(
        dist_checkpointing.serialization.get_default_save_sharded_strategy("torch_dist"),
        cast(dist.ProcessGroup, parallel_state.get_data_parallel_group(with_context_parallel=True)))

    def finalize() -> None:
        if policy.ranks.rank == 0:
            _write_hf_files(policy.hf_dir, path / HF_FILES_DIR)
            tmp = path / (META_FILE + ".tmp")
            tmp.write_text(json.dumps(meta, indent=2, default=str))
            os.replace(tmp, path / META_FILE)
        dist.barrier()

    use_async = async_save and torch.cuda.is_available()
    if async_save and not use_async:
        log.warning("checkpoint.async_save needs CUDA: saving synchronously")
    with cpu_compat.cuda_tensor_methods(), (contextlib.nullcontext() if use_async else _in_process_results_queue()):
        request = dist_checkpointing.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=use_async,
                                          content_metadata=dict(sharding))
    if request is None:
        finalize()
        return
    request.add_finalize_fn(finalize)
    _async_queue().schedule_async_request(request)


@contextlib.contextmanager
def _in_process_results_queue() -> Iterator[None]:
    """A synchronous save's write results pass through a queue in this process. megatron-core's
    torch_dist writer (strategies/filesystem_async.py) hands every save's results, sync or async,
    through one queue served by a spawn-context multiprocessing Manager, built for its async path
    (results put by the background writer process, read by the rank). A synchronous save puts and
    reads them in the rank itself, so a Manager only costs: a fresh process at each rank's first save
    that imports torch to unpickle the results (~3 s of the first save's wall time and CPU per rank
    and run: tools/bench_ckpt_save.py, 3.4 s vs 0.1-0.2 s at 8 and 64 MB). The Manager queue megatron keeps in a module
    global is swapped for an in-process queue for the save and put back after it (an async save later
    in the run builds its Manager as before). A megatron-core without that global keeps its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    kept = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


def _async_queue() -> Any:
    """megatron-core's queue of async saves, one per rank, with a persistent writer process."""
    global _ASYNC_QUEUE
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if _ASYNC_QUEUE is None:
        _ASYNC_QUEUE = AsyncCallsQueue(persistent=True)
        atexit.register(_stop_async_writer_at_exit)
    return _ASYNC_QUEUE


def finalize_async_saves(blocking: bool = True) -> int:
    """Run the finalization of finished async saves (all of them if `blocking`); returns how
    many are still pending. Collective; a no-op without async saves."""
    if _ASYNC_QUEUE is None:
        return 0
    _ASYNC_QUEUE.maybe_finalize_async_calls(blocking=blocking)
    return _ASYNC_QUEUE.get_num_unfinalized_calls()


def close_async_saves() -> None:
    """At the trainer's shutdown (every rank, before the process group goes): stop megatron-core's
    persistent writer process. It is a non-daemon child waiting on its queue: a rank that exits
    without this waits for it forever in multiprocessing's exit handler (seen on an H200: the
    async-save GPU test's rank never exited; a run's rank was killed after TrainerGroup.close's
    30 s). With nothing pending (a run's driver finalizes every save before it shuts the trainer
    down) the writer is told to stop and joined. A save still pending is one the driver gave up
    on: it stays incomplete (no mlrl_checkpoint.json; resume skips it) and the writer is killed,
    as is a writer that died, rather than finalizing with a collective a stuck rank would hang."""
    global _ASYNC_QUEUE
    queue = _ASYNC_QUEUE
    if queue is None:
        return
    pending, alive = queue.get_num_unfinalized_calls(), _writer_alive(queue)
    if pending or not alive:
        log.warning("trainer shutdown: stopping the async checkpoint writer (%s; %d save(s) left unfinalized, "
                    "hence incomplete)", "alive" if alive else "dead", pending)
        _abort_writer(queue)
    else:
        queue.close()  # raising, it stays set: the exit handler below then stops the writer
    _ASYNC_QUEUE = None


def _writer_alive(queue: Any) -> bool:
    process = getattr(getattr(queue, "persistent_caller", None), "process", None)
    return process is None or process.is_alive()


def _abort_writer(queue: Any) -> None:
    try:
        queue.close(abort=True)  # kills the writer, no collective
    except Exception:  # megatron's close logs the process group's rank first: without a group it raises
        process = getattr(getattr(queue, "persistent_caller", None), "process", None)
        if process is not None:
            process.kill()


def _stop_async_writer_at_exit() -> None:
    """atexit: a rank leaving without close_async_saves (the driver vanished, an error) kills the
    writer, with no collective, so that the exit does not hang; a save still unfinalized stays
    incomplete (no mlrl_checkpoint.json), which resume skips. Registered after multiprocessing's
    own exit handler, so it runs before that handler joins the writer."""
    global _ASYNC_QUEUE
    queue, _ASYNC_QUEUE = _ASYNC_QUEUE, None
    if queue is None:
        return
    pending = queue.get_num_unfinalized_calls()
    log.warning("exit without close_async_saves: stopping the async checkpoint writer (%d save(s) left "
                "unfinalized, hence incomplete)", pending)
    _abort_writer(queue)


def _write_hf_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in COPY_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, dst / f)


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return "unknown"


# ---- load ----------------------------------------------------------------------------------------
def load_checkpoint(policy, path: str | Path, *, load_optimizer: Optional[bool] = None) -> dict[str, Any]:
    """Load a checkpoint saved by `save_checkpoint` (any layout Megatron can reshard from) into
    the policy, in place. `load_optimizer=None` loads the optimizer / scheduler / RNG state when
    the policy is trainable and the checkpoint has it; False loads the weights only. Returns
    {"optimizer_steps", "optimizer_loaded", "rng_restored", "saved_layout", "scheduler_overrides"}."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    trainable = policy.optimizer is not None
    if load_optimizer is None:
        load_optimizer = trainable
    if load_optimizer and not trainable:
        raise CheckpointError("load_checkpoint(load_optimizer=True) on a frozen policy (trainable=False)")
    error: Optional[CheckpointError] = None
    meta: dict[str, Any] = {}  # set below on every rank that _agree lets through
    contents: dict[str, Any] = {}
    with_optimizer = False
    try:
        meta = read_meta(path)
        contents = meta["contents"]
        with_optimizer = load_optimizer and contents["optimizer"]
        check_loadable(policy, meta, load_optimizer=with_optimizer)
    except CheckpointError as e:
        error = e
    _agree(policy, path, error)
    same_layout = meta["layout"] == _layout(policy)
    with_rng = load_optimizer and contents["rng"] and same_layout
    sharding = meta["optimizer"]["sharding"]

    from mlrl.trainer.rank import cpu_compat

    with cpu_compat.cuda_tensor_methods():
        sd = _state_dict(policy, sharding=sharding, optimizer=with_optimizer, rng=with_rng, is_loading=True)
        if load_optimizer and contents["scheduler"] and not with_optimizer:
            sd["scheduler"] = policy.scheduler.state_dict()
        state = cast(dict[str, Any], dist_checkpointing.load(sd, str(path)))  # strict left as is: the state only
        for key, chunk in zip(_model_keys(policy), _unwrapped(policy)):
            if _lora(policy) is None:
                chunk.load_state_dict(state[key], strict=True)
                continue
            missing, unexpected = chunk.load_state_dict(state[key], strict=False)  # the adapters only
            bad = [n for n in missing if _is_adapter(n)] + list(unexpected)
            if bad:
                raise CheckpointError(f"checkpoint {path}: adapter tensors missing or unexpected: {bad[:3]}")
        steps = int(meta["optimizer"]["steps"])
        overrides: dict[str, Any] = {}
        if with_optimizer:
            _load_optimizer_state(policy.optimizer, state["optimizer"])
            _fix_step_state(policy.optimizer, steps)
        elif trainable:
            # weights changed under the optimizer: refresh its fp32 main copies (bf16 / distributed)
            policy.optimizer.reload_model_params()
    if load_optimizer and contents["scheduler"]:
        overrides = _load_scheduler(policy.scheduler, state["scheduler"])
        policy.optimizer_steps = steps
    if with_rng:
        _set_rng_state(state["rng_state"])
    return {"optimizer_steps": policy.optimizer_steps, "optimizer_loaded": with_optimizer, "rng_restored": with_rng,
            "saved_layout": meta["layout"], "scheduler_overrides": overrides}


def _agree(policy, path: Path, error: Optional[CheckpointError]) -> None:
    """Every rank raises, or none loads (a rank that alone failed would leave the others in a collective)."""
    failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=policy.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if int(failed):
        raise CheckpointError(f"checkpoint {path}: rejected on another rank (see that rank's error)")


def init_weights_from(policy, spec: str):
    """model.init_from: replace the built policy's weights (model.hf_dir's) by those of an mlrl
    checkpoint or a Hugging Face folder (`check_init_from` tells which; the driver ran the same
    check before any process started). Collective. With LoRA they become the frozen base (the
    adapters stay fresh). Returns the `InitSource`; a later checkpoint of this policy records it."""
    from mlrl.bridge import HFCheckpoint

    source = check_init_from(spec, policy.hf_config)
    if source.kind == "checkpoint":
        load_model_weights(policy, source.weights)
    else:
        ckpt = HFCheckpoint(source.weights)
        if not via_mbridge(policy):  # megatron-bridge checks the tensors as it loads them
            ckpt.check(policy.spec, policy.arch)
        policy.params.load_hf(ckpt)  # the base parameters (LocalParams never holds adapters)
        if policy.optimizer is not None:
            policy.optimizer.reload_model_params()  # its fp32 main copies (bf16 / distributed)
    policy.init_from = source
    return source


# TE's fused layernorm + linear names the norm after the linear; LoRA builds the TE spec with the
# norm unfused (mlrl.trainer.rank.model._te_block_spec), which names it after the norm. Megatron's
# local spec saves the fused names too (its sharded_state_dict_keys_map).
_NORM_KEY_ALIASES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                     ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def _to_saved_keys(sd: dict[str, Any], saved: set[str]) -> list[str]:
    """Point the entries of one chunk's sharded state dict that the checkpoint names differently
    at the saved names (`_NORM_KEY_ALIASES`), in place; drop TE `_extra_state` entries the
    checkpoint lacks (FP8 metadata, no weights). Returns the state-dict names dropped."""
    dropped = []
    for name, item in list(sd.items()):
        key = getattr(item, "key", None)
        if key is None or key in saved:
            continue
        alias = next((key.replace(a, b) for a, b in _NORM_KEY_ALIASES if a in key and key.replace(a, b) in saved), None)
        if alias is not None:
            item.key = alias
        elif name.endswith("_extra_state"):
            dropped.append(name)
            del sd[name]
    return dropped


def load_model_weights(policy, path: str | Path) -> None:
    """Collective: only the model weights of a checkpoint written by `save_checkpoint` (any
    layout Megatron can reshard from) into a built policy, in place; its optimizer state,
    scheduler and RNG stay as they are (model.init_from: a fresh run from another run's weights).
    The checkpoint must hold full weights (not a LoRA run's adapters); with LoRA on this policy
    they load into the frozen base and the adapters are untouched."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    error: Optional[CheckpointError] = None
    meta: dict[str, Any] = {}  # set below on every rank that _agree lets through
    try:
        meta = read_meta(path)
        _check_role(policy, meta)
        if meta.get("lora"):
            raise CheckpointError(f"checkpoint {path}: holds LoRA adapters only (base {meta.get('base_hf_dir')}), not "
                                  "full weights: load the LoRA run's merged HF export instead")
        _check_arch(policy, meta)
    except CheckpointError as e:
        error = e
    _agree(policy, path, error)
    sharding = meta["optimizer"]["sharding"]
    sd = {k: {n: t for n, t in m.sharded_state_dict(metadata=dict(sharding)).items() if not _is_adapter(n)}
          for k, m in zip(_model_keys(policy), _unwrapped(policy))}
    dropped: set[str] = set()
    if _lora(policy) is not None:  # the only model here whose names can differ from a full checkpoint's
        from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

        saved = set(load_sharded_metadata(str(path)))
        for chunk_sd in sd.values():
            dropped.update(_to_saved_keys(chunk_sd, saved))
    from mlrl.trainer.rank import cpu_compat

    with cpu_compat.cuda_tensor_methods():
        state = cast(dict[str, Any], dist_checkpointing.load(sd, str(path)))  # strict left as is: the state only
        for key, chunk in zip(_model_keys(policy), _unwrapped(policy)):
            missing, unexpected = chunk.load_state_dict(state[key], strict=False)
            bad = [n for n in missing if not _is_adapter(n) and n not in dropped] + list(unexpected)
            if bad:
                raise CheckpointError(f"checkpoint {path}: model tensors missing or unexpected: {bad[:3]}")
        if policy.optimizer is not None:
            policy.optimizer.reload_model_params()  # weights changed under the optimizer: its fp32 main copies


def _model_keys(policy) -> list[str]:
    return ["model"] if len(policy.model) == 1 else [f"model{i}" for i in range(len(policy.model))]


def _load_scheduler(scheduler, saved: dict[str, Any]) -> dict[str, Any]:
    """Position from the checkpoint, hyper-parameters from the running config."""
    now = scheduler.state_dict()
    overrides = {
        k: {"checkpoint": saved[k], "config": now[k]} for k in now if k != "num_steps" and saved.get(k) != now[k]
    }
    previous = scheduler.override_opt_param_scheduler
    scheduler.override_opt_param_scheduler = True
    try:
        scheduler.num_steps = 0
        with _quiet("megatron.core.optimizer_param_scheduler"):
            scheduler.load_state_dict(saved)
    finally:
        scheduler.override_opt_param_scheduler = previous
    if overrides:
        log.warning("resume: the LR schedule follows the config, not the checkpoint, for %s", sorted(overrides))
    return overrides


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    lg = logging.getLogger(logger_name)
    level = lg.level
    lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lg.setLevel(level)
