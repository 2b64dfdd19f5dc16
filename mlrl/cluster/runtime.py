"""Starting the run's processes on the nodes `join_cluster` reserved (`--nodes N`).

One `NodeAgent` Ray actor per plan node (pinned to that machine with a hard node-affinity
strategy, zero resources of its own: the node's placement group holds the GPUs) starts, watches
and stops the processes placed there:
- trainer ranks: `python -m mlrl.trainer.rank.service --connect DRIVER:PORT` with torchrun's environment
  from the assignment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, CUDA_VISIBLE_DEVICES); they
  connect back to the driver's `TrainerGroup`, so nothing else changes for the loop;
- engines: an `mlrl.rollout.server.EngineServer` held by the agent (the same supervisor and vLLM
  command as on one machine), listening on the node's address with the per-job token; the driver's
  `EnginePool` talks HTTP to it through `RemoteEngineServer`.
Every process is a child of its agent (its supervisor / PR_SET_PDEATHSIG kill it when the agent
goes), and the agents are owned by the driver: when the driver exits, Ray kills the agents, and
with them everything they started.

Paths (model folder, run / checkpoint directory) must name the same files on every node: a
shared filesystem, as on any Slurm cluster. The config travels over the trainer connection.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlrl.cluster.assignment import ClusterAssignment, ClusterError, TrainerWorker
from mlrl.procs import kill_tree
from mlrl.rollout.server import EngineServer, ServerSpec

logger = logging.getLogger(__name__)

AGENT_CONCURRENCY = 16  # threaded actor: a slow stop() must not block alive() probes


class NodeAgent:
    """Runs on one node (as a Ray actor); see the module docstring."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineServer] = {}
        self._ranks: dict[int, tuple[subprocess.Popen, Path]] = {}

    def describe(self) -> tuple[str, str, bool]:
        """(Ray node id, IP, whether CUDA is usable here)."""
        import ray
        import torch

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), torch.cuda.is_available()

    # ---- engines
    def start_engine(self, spec: ServerSpec) -> int:
        srv = self._engines.get(spec.name)
        if srv is None:
            srv = self._engines[spec.name] = EngineServer(spec)
        srv.start()
        assert srv.port is not None  # set by start()
        return srv.port

    def engine_alive(self, name: str) -> bool:
        return self._engines[name].alive()

    def engine_exit_code(self, name: str) -> int | None:
        return self._engines[name].exit_code()

    def engine_stop(self, name: str, timeout_s: float) -> None:
        if name in self._engines:
            self._engines[name].stop(timeout_s)

    def engine_crash(self, name: str) -> None:
        self._engines[name].crash()

    def engine_log_tail(self, name: str, lines: int) -> str:
        srv = self._engines.get(name)
        return srv.log_tail(lines) if srv is not None else "(engine never started on this node)"

    # ---- trainer ranks
    def start_rank(self, rank: int, service_args: list[str], env: dict[str, str], log_path: str) -> int:
        from mlrl.trainer.driver.group import die_with_parent

        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
        with open(log, "ab") as f:
            proc = subprocess.Popen([sys.executable, *service_args], stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=full_env, start_new_session=True,
                                    preexec_fn=die_with_parent)
        self._ranks[rank] = (proc, log)
        return proc.pid

    def ranks_wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for proc, _ in self._ranks.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def ranks_kill(self) -> None:
        for proc, _ in self._ranks.values():
            kill_tree(proc.pid)  # torchrun's workers run in sessions of their own
            proc.wait()

    def ranks_log_tail(self, lines: int) -> str:
        out = []
        for rank, (proc, log) in sorted(self._ranks.items()):
            try:
                text = log.read_bytes()[-20_000:].decode("utf-8", "replace")
            except OSError:
                text = "(no log)"
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            out.append(f"--- rank {rank} ({state}, {log}):\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        for srv in self._engines.values():
            srv.stop(timeout_s)
        if not self.ranks_wait(timeout_s):
            self.ranks_kill()


class RayRanks:
    """`RankProcesses` for `TrainerGroup`: one process per rank, started by the rank's node agent."""

    def __init__(self, agents: dict[int, Any], workers: list[TrainerWorker], service_args: list[str],
                 env: dict[str, str], log_dir: Path):
        import ray

        self._ray = ray
        self._agents = {w.node: agents[w.node] for w in workers}
        ray.get(
            [
                agents[w.node].start_rank.remote(
                    w.rank, service_args, {**env, **w.env}, str(log_dir / f"rank-{w.rank}.log")
                )
                for w in workers
            ]
        )

    # Each agent is asked on its own: a dead node (its agent gone, RayActorError) must not replace the
    # error being reported (a lost rank's TrainerError carries these log tails) or stop the teardown
    # (TrainerGroup.close -> wait / kill, then the placement's release); its ranks died with it.
    def _ask(self, call: Any, timeout_s: float, dead: Any) -> Any:
        try:
            return self._ray.get(call, timeout=timeout_s)
        except Exception as e:  # the agent (node) is gone or unreachable: said, and its ranks went with it
            logger.warning("trainer ranks: a node agent did not answer (%s: %s)", type(e).__name__, e)
            return dead(e) if callable(dead) else dead

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        done = True
        for a in self._agents.values():
            left = max(0.0, deadline - time.monotonic())
            done = self._ask(a.ranks_wait.remote(left), left + 30, True) and done
        return done

    def kill(self) -> None:
        for a in self._agents.values():
            self._ask(a.ranks_kill.remote(), 60, None)

    def log_tail(self, lines: int = 40) -> str:
        calls = {node: a.ranks_log_tail.remote(lines) for node, a in self._agents.items()}  # all asked at once
        return "\n".join(self._ask(call, 30, lambda e, node=node: f"(node {node}: log unavailable, "
                                                                f"{type(e).__name__}: {e})")
                         for node, call in calls.items())


class RemoteEngineServer(EngineServer):
    """An `EngineServer` whose process tree its node agent runs; readiness (GET /health with the
    token) and the start-up failure report are the base class's, seen from the driver."""

    def __init__(self, spec: ServerSpec, agent: Any):  # no local log folder, no local process
        import ray

        self._ray = ray
        self.spec = spec
        self.agent = agent
        self.port: int | None = None
        self.starts = 0
        self.log_path = Path(spec.log_path or f"{spec.name}.log")  # on the engine's node

    def start(self, gated: bool = False) -> None:
        if gated:  # EnginePool.prestart is for engines on the launching machine only
            raise ValueError(f"engine {self.spec.name}: a node agent's engine cannot start gated")
        self.port = self._ray.get(self.agent.start_engine.remote(self.spec))
        self.starts += 1

    def alive(self) -> bool:
        try:
            return bool(self._ray.get(self.agent.engine_alive.remote(self.spec.name), timeout=30))
        except Exception:  # the agent (node) is gone or unreachable: the engine is too
            return False

    def exit_code(self) -> int | None:
        try:
            return self._ray.get(self.agent.engine_exit_code.remote(self.spec.name), timeout=30)
        except Exception:
            return None

    def stop(self, timeout_s: float = 30.0) -> None:
        try:
            self._ray.get(self.agent.engine_stop.remote(self.spec.name, timeout_s))
        except Exception:  # agent gone: its processes went with it
            pass

    def crash(self) -> None:
        self._ray.get(self.agent.engine_crash.remote(self.spec.name))

    def log_tail(self, lines: int = 40) -> str:
        try:
            return self._ray.get(self.agent.engine_log_tail.remote(self.spec.name, lines), timeout=30)
        except Exception as e:
            return f"(log unavailable: {e})"


class ClusterRuntime:
    """The agents of one run, and the factories `jobs/rl.py` hands to `TrainerGroup` / `EnginePool`."""

    def __init__(self, assignment: ClusterAssignment, run_dir: str | Path):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self.assignment = assignment
        self.run_dir = Path(run_dir)
        self.driver_ip = ray.util.get_node_ip_address()
        actor = ray.remote(NodeAgent)
        self.agents: dict[int, Any] = {  # actor handles (Ray's stubs type their methods without .remote)
            n.index: actor.options(
                num_cpus=0,
                max_concurrency=AGENT_CONCURRENCY,
                name=f"mlrl-agent-{os.getpid()}-{n.index}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
            ).remote()
            for n in assignment.nodes
        }
        try:
            found = ray.get([a.describe.remote() for a in self.agents.values()], timeout=300)
            for n, (node_id, ip, _) in zip(assignment.nodes, found):
                if (node_id, ip) != (n.node_id, n.ip):
                    raise ClusterError(f"the agent for plan node {n.index} runs on node {node_id} ({ip}); "
                                       f"its reservation is on {n.node_id} ({n.ip})")
        except BaseException:
            self.close()
            raise
        # the weight-sync backend follows the nodes, not the driver: NCCL where the nodes have CUDA
        # (a cluster simulated with fake GPUs has none: gloo, like every CPU run)
        self.cuda = all(cuda for _, _, cuda in found)
        self.write_record(found)

    def write_record(self, found: list[tuple[str, str, bool]]) -> Path:
        """<run dir>/placement.json: which node and GPUs every trainer rank and engine got."""
        a = self.assignment
        record = {
            "driver_ip": self.driver_ip,
            "nodes": [{"plan_node": n.index, "node_id": n.node_id, "ip": n.ip, "gpu_ids": list(n.gpu_ids),
                       "cuda": cuda} for n, (_, _, cuda) in zip(a.nodes, found)],
            "trainer": [{"rank": w.rank, "plan_node": w.node, "node_id": w.node_id, "gpu_id": w.gpu_id,
                         "env": dict(w.env)} for w in a.trainers],
            "engines": [{"engine": e.engine, "plan_node": e.node, "node_id": e.node_id, "gpu_ids": list(e.gpu_ids)}
                        for e in a.engines],
        }
        out = self.run_dir / "placement.json"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(out)
        return out

    def spawn_trainer(self, service_args: list[str], env: dict[str, str]) -> RayRanks:
        return RayRanks(self.agents, self.assignment.trainers, service_args, env, self.run_dir / "trainer")

    def engine_server(self, index: int, spec: ServerSpec) -> RemoteEngineServer:
        e = self.assignment.engines[index]
        spec = dataclasses.replace(spec, host=e.node_ip, cuda_devices=list(e.gpu_ids))
        return RemoteEngineServer(spec, self.agents[e.node])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop whatever the agents still run, then the agents; the reservation is released by the caller."""
        try:
            self._ray.get([a.shutdown.remote(timeout_s) for a in self.agents.values()], timeout=3 * timeout_s)
        except Exception:  # an agent already gone took its processes with it; kill the rest below
            pass
        finally:
            for a in self.agents.values():
                self._ray.kill(a)
            self.agents = {}
