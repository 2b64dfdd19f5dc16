"""The RL job's entry (`run`): its first moments, before the job's own imports.

On one machine the policy's engine processes start here, gated (`EnginePool.prestart`): each
imports vLLM's server (~7-8 s of one core, most of an engine's start) and builds nothing (no
port, model or memory) until `pool.start()` opens its gate. This module imports nothing heavy
(no torch, transformers or trainer driver: `tests/unit/test_jobs.py`), so the engines start
~0.4 s after the process, and the driver's own imports (torch, transformers: ~1.5 s) and cheap
checks (mlrl.jobs.rl) run beside them. With --nodes the Ray placement comes first and nothing
starts here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlrl.config import Config, Layout
from mlrl.jobs.placement import Placement, local_placement
from mlrl.modelzoo import resolve_model_dir
from mlrl.rollout.pool import EnginePool

log = logging.getLogger("mlrl")


class StartupClock:
    """Where start-up went: seconds from this process's creation to each mark, and the span of the
    engines' and the trainer ranks' start (they run concurrently). Written to
    `<run dir>/startup.json` and logged once training starts."""

    def __init__(self) -> None:
        import psutil

        self.t0 = psutil.Process().create_time()
        self.marks: dict[str, float] = {"launch_s": time.time() - self.t0}  # imports, config checks
        self.spans: dict[str, float] = {}
        self.notes: dict[str, float] = {}  # facts about the start (e.g. the first sync's bytes)

    def mark(self, name: str) -> None:
        self.marks[f"{name}_s"] = time.time() - self.t0

    def note(self, name: str, value: float) -> None:
        self.notes[name] = float(value)

    async def span(self, name: str, awaitable: Any, since: float | None = None) -> Any:
        """`since`: the time.time() the span began, when earlier than this call (prestarted engines)."""
        t = time.time() if since is None else since
        try:
            return await awaitable
        finally:
            self.spans[f"{name}_s"] = time.time() - t

    def write(self, run_dir: Path) -> dict[str, float]:
        out = {**self.marks, **{f"span/{k}": v for k, v in self.spans.items()}, **self.notes}
        (run_dir / "startup.json").write_text(json.dumps(out, indent=1) + "\n")
        log.info("start-up %.1f s: %s", self.marks.get("ready_s", 0.0),
                 ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
        return out


def policy_pool(cfg: Config, placement: Placement, hf_dir: Path, run_dir: Path) -> EnginePool:
    """The policy's engine pool (not started) on `placement`'s engine devices."""
    adapters = cfg.model.lora is not None and cfg.weight_sync.lora_mode == "adapter"
    devices = placement.engine_devices  # local GPUs: the policy's engines, then the judge's
    n = cfg.rollout.num_engines
    return EnginePool(cfg.rollout, hf_dir, dtype=cfg.model.dtype, run_dir=run_dir,
                      cuda_devices=devices[:n] if devices is not None else None,
                      server_factory=placement.engine_server,
                      lora_rank=cfg.model.lora.rank if adapters and cfg.model.lora is not None else None,
                      sleep_mode=cfg.cluster.placement == "colocated",
                      # colocated engines are not restarted: a restarted engine would hold its memory while the
                      # trainer steps, and its weight refresh would skip the sleep / offload sequence around the
                      # trainer's (offloaded) parameters; the run goes on with the other engines, or stops
                      # clearly when none is left
                      max_restarts=0 if cfg.cluster.placement == "colocated" else 3,
                      capture_routing=cfg.algorithm.router_replay)


@dataclass
class EarlyStart:
    """What `begin` did: the clock, the model folder and, on one machine, the placement and the
    prestarted (gated) policy pool with the time its engines' span began."""

    clock: StartupClock
    hf_dir: Path
    placement: Placement | None = None
    pool: EnginePool | None = None
    engines_since: float | None = None


def begin(cfg: Config, layout: Layout) -> EarlyStart:
    """Start the clock, resolve the model folder and, on one machine, prestart the policy's engines."""
    clock = StartupClock()
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    early = EarlyStart(clock, resolve_model_dir(cfg.model.hf_dir))
    if cfg.cluster.nodes == 1:
        early.placement = local_placement(cfg, layout)
        early.pool = policy_pool(cfg, early.placement, early.hf_dir, run_dir)
        clock.mark("prestart")  # the engines' span begins here
        early.engines_since = clock.t0 + clock.marks["prestart_s"]
        early.pool.prestart()
    return early


def run(cfg: Config, layout: Layout) -> int:
    """The RL job: engines prestarted first, then the job itself (mlrl.jobs.rl), which stops them
    if a check fails."""
    early = begin(cfg, layout)
    from mlrl.jobs import rl

    return rl.run(cfg, layout, early)
