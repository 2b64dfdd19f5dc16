"""Rank side of the trainer: `python -m mlrl.trainer.rank.service --connect HOST:PORT` under torchrun
(or started by a Ray node agent with torchrun's environment). Connects back to the driver
(`mlrl.trainer.driver.group.TrainerGroup`), receives the resolved config (YAML) from it, then serves
method calls until `shutdown` or until the driver's connection closes (the driver died: exit
rather than linger as an orphan).

Every public method of `TrainerService` is callable by name from the driver; each call is a
collective over all ranks, so the driver always sends it to every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import traceback
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist

from mlrl.algorithms.loss_metrics import finalize_loss_metrics
from mlrl.algorithms.losses import make_loss_fn
from mlrl.config import Config, config_from_yaml, validate
from mlrl.experience.batch import MicroBatch
from mlrl.interfaces import ResumeInfo
from mlrl.procs import exit_without_finalising
from mlrl.trainer.rpc import TOKEN_ENV, RankRouterDiagnostics, no_delay, recv, send


def critic_body_dir(critic_cfg: Any, policy_dir: Path) -> Path:
    """The folder the critic's body is initialised from: critic.hf_dir, or the policy's model."""
    from mlrl.modelzoo import resolve_model_dir

    return resolve_model_dir(critic_cfg.hf_dir, field="critic.hf_dir") if critic_cfg.hf_dir else policy_dir


class TrainerService:
    """What one rank can do: built once, then called step after step."""

    def __init__(self, cfg: Config):
        from mlrl.modelzoo import resolve_model_dir
        from mlrl.trainer.rank.policy import MegatronPolicy, init_parallel

        self.cfg = cfg
        self.layout = validate(cfg)
        init_parallel(cfg.parallel, self.layout, seed=cfg.trainer.seed)
        hf_dir = resolve_model_dir(cfg.model.hf_dir)
        self.reward_model = None
        self.policy: MegatronPolicy  # a reward model's run: the MegatronRewardModel (a subclass)
        if cfg.rm is not None:  # reward-model training (mlrl.jobs.rm): the trained model has a scalar head
            from mlrl.trainer.rank.reward_model import MegatronRewardModel

            self.reward_model = MegatronRewardModel(cfg.model, cfg.parallel, cfg.trainer, self.layout, hf_dir=hf_dir)
            self.policy = self.reward_model  # checkpoints, export, offload and rank info take it as the policy
        else:
            self.policy = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, self.layout, hf_dir=hf_dir,
                                         trainable=True, total_updates=cfg.policy_updates)
        self.ref = None
        # the frozen reference (KL, and DPO's reference policy); LoRA: the base, adapters off. A teacher
        # (algorithm.reference_hf_dir) is a model of its own, without the policy's adapters or init_from
        teacher = cfg.algorithm.reference_hf_dir if cfg.algorithm.kl_coef > 0 else None
        if teacher:
            teacher_dir = resolve_model_dir(teacher, field="algorithm.reference_hf_dir")
            self.ref = MegatronPolicy(dataclasses.replace(cfg.model, lora=None), cfg.parallel, cfg.trainer,
                                      self.layout, hf_dir=teacher_dir, trainable=False)
        elif (cfg.algorithm.kl_coef > 0 or cfg.dpo is not None) and self.policy.lora is None:
            self.ref = MegatronPolicy(cfg.model, cfg.parallel, cfg.trainer, self.layout, hf_dir=hf_dir, trainable=False)
        if cfg.model.init_from:  # the run starts from another run's weights: the policy AND the KL reference
            from mlrl.trainer.rank.dist_ckpt import init_weights_from

            # (on resume the checkpoint then replaces the policy's); a teacher keeps its own weights
            for model in (self.policy, None if teacher else self.ref):
                if model is not None:
                    init_weights_from(model, cfg.model.init_from)
        if cfg.algorithm.router_replay:  # MoE R3: every forward routes like the engines did
            for model in (self.policy, self.ref):
                if model is not None:
                    model.router_mode = "replay"
        self.loss_fn = make_loss_fn(cfg.algorithm)
        if cfg.sft is not None:  # supervised fine-tuning (mlrl.jobs.sft): NLL of the assistant tokens
            from mlrl.algorithms.sft_loss import sft_loss

            self.loss_fn = sft_loss
        if cfg.dpo is not None:  # preference optimisation (mlrl.jobs.dpo): DPO / IPO on whole pairs
            from mlrl.algorithms.dpo_loss import make_dpo_loss_fn

            self.loss_fn = make_dpo_loss_fn(cfg.dpo.beta, cfg.dpo.loss_type)
        if cfg.rm is not None:  # reward-model training: Bradley-Terry on whole pairs
            from mlrl.algorithms.rm_loss import make_rm_loss_fn

            self.rm_loss_fn = make_rm_loss_fn(cfg.rm.center_rewards_coefficient)
        self.critic = None
        if cfg.uses_critic:  # the value model shares the trainer ranks and their parallel layout
            from mlrl.algorithms.value import make_value_loss_fn
            from mlrl.trainer.rank.critic import MegatronCritic

            critic_cfg = cfg.critic
            assert critic_cfg is not None  # uses_critic implies a critic section
            body = critic_body_dir(critic_cfg, hf_dir)
            self.critic = MegatronCritic(cfg.model, critic_cfg, cfg.parallel, cfg.trainer, self.layout, hf_dir=body)
            self.value_loss_fn = make_value_loss_fn(critic_cfg.value_clip)

    def info(self) -> dict[str, Any]:
        return self.policy.rank_info()

    def compute_logprobs(self, micro_batches: list[MicroBatch], temperature: float,
                         reference: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if reference and self.policy.lora is not None and self.ref is None:
            with self.policy.lora.disabled():
                return self.policy.compute_logprobs(micro_batches, temperature)
        model = self.ref if reference else self.policy
        if model is None:
            raise RuntimeError("reference logprobs asked of a trainer without a reference model (algorithm.kl_coef=0 "
                               "and no dpo section)")
        return model.compute_logprobs(micro_batches, temperature)

    def router_diagnostics(self, micro_batches: list[MicroBatch], temperature: float) -> RankRouterDiagnostics:
        """MoE router replay, on the current weights: logprobs with the engine's routes replayed
        and with the trainer's own routing, and how often the trainer's own top-k sets equal the
        engine's (token x MoE layer)."""
        replay = self.policy.compute_logprobs(micro_batches, temperature, router="replay")
        own = self.policy.compute_logprobs(micro_batches, temperature, router="record")
        matches, compared = self.policy.router_agreement_counts()
        return RankRouterDiagnostics(replay=[lp for lp, _ in replay], own=[lp for lp, _ in own],
                                     matches=matches, compared=compared)

    def update(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        if self.reward_model is not None:
            return finalize_loss_metrics(self.reward_model.update(micro_batches, self.rm_loss_fn))
        temperature = self.cfg.rollout.sampling.logprob_temperature
        sums = self.policy.update(micro_batches, self.loss_fn, temperature=temperature)
        return finalize_loss_metrics(sums)  # step sums -> means (token / sequence counts) per loss_metrics

    def compute_scores(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """A reward-model run: per-position scores [S] per micro-batch (mlrl.algorithms.rm_loss reads
        each sequence's last)."""
        if self.reward_model is None:
            raise RuntimeError("compute_scores on a trainer that trains no reward model (config has no `rm:` section)")
        return self.reward_model.compute_scores(micro_batches)

    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        return self._critic().compute_values(micro_batches)

    def update_critic(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        return finalize_loss_metrics(self._critic().update(micro_batches, self.value_loss_fn))

    def _critic(self):
        if self.critic is None:
            raise RuntimeError("this trainer has no critic (config has no `critic:` section)")
        return self.critic

    def push_weights(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's part of a weight sync (mlrl.weight_sync.sender): the sender of each
        pipeline stage streams its stage's HF tensors; the other ranks take part in the gathers."""
        from mlrl.weight_sync.sender import bucketize, push_from_rank

        info = self.policy.rank_info()
        sender = info["pp"] if info["is_stage_sender"] else None
        buckets = self.policy.iter_hf_buckets
        if request.get("content") == "adapters":  # weight_sync.lora_mode=adapter: the LoRA adapters only
            def buckets(bucket_bytes):
                return bucketize(self.policy.iter_adapters(), bucket_bytes)
        report = push_from_rank(request, buckets, sender)
        return report.to_json() if report is not None else None

    def offload(self, kinds: list[str]) -> dict[str, Any]:
        """Colocated placement: release the device memory of `kinds` ("params", "grads",
        "optimizer") of every model on this rank (policy, KL reference, critic) into host buffers
        (mlrl.trainer.rank.offload). Kinds already offloaded are skipped."""
        return self._offloader().offload(kinds).to_json()

    def reload(self, kinds: list[str] | None = None) -> dict[str, Any]:
        """Bring what `offload` moved (`kinds`: only those) back to the device, bytes unchanged
        (gradients zeroed)."""
        return self._offloader().reload(kinds).to_json()

    def _offloader(self):
        if getattr(self, "_offload", None) is None:
            from mlrl.trainer.rank.offload import Offloader

            self._offload = Offloader([self.policy, self.ref, self.critic])
        return self._offload

    def save_checkpoint(self, path: str, critic_path: str | None = None) -> None:
        from mlrl.trainer.rank.dist_ckpt import save_checkpoint

        save_checkpoint(self.policy, path, async_save=self.cfg.checkpoint.async_save)
        if critic_path is not None:
            save_checkpoint(self._critic(), critic_path, async_save=self.cfg.checkpoint.async_save)

    def finalize_checkpoints(self, blocking: bool = True) -> int:
        """Finalize the async saves whose background writes are done (all of them, waiting, if
        `blocking`): megatron-core's metadata and our mlrl_checkpoint.json get written. Returns how
        many saves are still pending; every rank returns the same count (megatron-core agrees on
        "done" over all ranks), and 0 means every save so far is complete on every rank."""
        from mlrl.trainer.rank.dist_ckpt import finalize_async_saves

        return finalize_async_saves(blocking=blocking)

    def load_checkpoint(self, path: str, critic_path: str | None = None) -> ResumeInfo:
        from mlrl.trainer.rank.dist_ckpt import load_checkpoint

        out = cast(ResumeInfo, load_checkpoint(self.policy, path))  # the reference stays the initial model
        if critic_path is not None:
            load_checkpoint(self._critic(), critic_path)
        return out

    def export_hf(self, out_dir: str) -> None:
        """Stream the HF tensors of every pipeline stage into one Hugging Face folder. With LoRA:
        the PEFT adapter folder at `out_dir/adapter`, and the merged model (W + s B A) at `out_dir`
        when checkpoint.export_merged."""
        from mlrl.ckpt_files.layout import ADAPTER_DIR
        from mlrl.trainer.rank.hf_export import export_hf, export_peft

        # in the trained parameters' dtype (model.dtype), as transformers' save_pretrained keeps a
        # model's: config.json's (a bf16 model trained in fp32) rounded most of a small-LR update away
        # (tools/convert_checkpoint.py mcore-to-hf --dtype writes another from the checkpoint)
        if self.policy.lora is None or self.cfg.checkpoint.export_merged:
            export_hf(self.policy, out_dir, dtype=None)
        if self.policy.lora is not None:
            export_peft(self.policy, os.path.join(out_dir, ADAPTER_DIR), dtype=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connect", required=True)
    args = ap.parse_args(argv)
    host, port = args.connect.rsplit(":", 1)
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV))
    rank = int(os.environ.get("RANK", "0"))
    conn = no_delay(Client((host, int(port)), authkey=token))
    try:
        # megatron's import (seconds) while the driver may still hold the config back (a colocated
        # run's engines start first: TrainerGroup's gate); it touches no device
        import mlrl.trainer.rank.policy  # noqa: F401

        cfg = config_from_yaml(recv(conn))
        service = TrainerService(cfg)
        send(conn, {"rank": rank, **service.info()})
    except BaseException:  # the driver reports it
        send(conn, {"rank": rank, "error": traceback.format_exc()})
        raise
    while True:
        try:
            method, kwargs = recv(conn)
        except (EOFError, ConnectionError, OSError):
            return 1  # the driver is gone
        if method == "shutdown":
            break
        try:
            fn = getattr(service, method) if not method.startswith("_") else None
            if fn is None:
                raise AttributeError(f"trainer has no method {method!r}")
            send(conn, ("ok", fn(**kwargs)))
        except BaseException:  # sent to the driver, which stops the run
            send(conn, ("err", traceback.format_exc()))
    from mlrl.trainer.rank.dist_ckpt import close_async_saves

    close_async_saves()  # every rank got `shutdown`: the async checkpoint writer stops
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _exit(code: int) -> NoReturn:
    """End the rank once `main` returned: the atexit handlers run (the async checkpoint writer's,
    multiprocessing's joins of its children, logging's flush), then the process ends without the
    interpreter's finalisation, whose teardown of torch, megatron-core and triton's native state
    took ~1 s of every run's end. Unlike a normal exit it does not wait for non-daemon threads: the
    rank starts none (its RPC loop runs in the main thread) and must not rely on one finishing."""
    exit_without_finalising(code, join_threads=False)


if __name__ == "__main__":
    _exit(main())
