"""`--nodes N`: join a Ray cluster, reserve the planned GPUs, and say who runs where.

Order kept (each step fails with a one-line ClusterError before anything starts):
  1. connect: ray.init(address=cluster.ray_address);
  2. wait until N alive nodes have >= cluster.gpus_per_node GPUs each (Slurm starts them in
     parallel, so they register over some seconds);
  3. reserve: one STRICT_PACK placement group per plan node, one bundle {"GPU": 1, "CPU": c} per
     GPU, pinned to a chosen Ray node with a bundle label selector on `ray.io/node-id`. Reserving
     whole nodes keeps two plan nodes from landing on one machine and makes plan node i a
     machine we chose (plan node 0 = the driver's node when it has GPUs: the head in Slurm);
  4. probe every bundle with a one-GPU task (node IP, the physical GPU id behind the bundle) and
     find free ports on each node (rendezvous, weight sync, one HTTP port per engine);
  5. `assignment.assign` maps the plan onto the probe: env for trainer workers and engines.
The runner then starts one node agent per plan node (`mlrl.cluster.runtime`), which launches the
trainer ranks and engines placed there with the environment from step 5, and calls `release` at
the end. Disaggregated and colocated plans differ only in which GPUs carry an engine (colocated
engines get the same CUDA_VISIBLE_DEVICES as the trainer ranks they share GPUs with).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

from mlrl.cluster.assignment import ClusterAssignment, ClusterError, NodeInfo, assign, ports_needed
from mlrl.config.schema import Config
from mlrl.plan import Plan

CPUS_PER_BUNDLE = 1.0
NODE_ID_LABEL = "ray.io/node-id"


def connect(address: str) -> None:
    """ray.init against an existing cluster (no-op if this process is already connected)."""
    import ray

    if not ray.is_initialized():
        _check_reachable(address)
        try:
            ray.init(address=address, namespace="mlrl", log_to_driver=True)
        except ConnectionError as e:
            raise ClusterError(f"cluster.ray_address={address!r}: cannot connect to a Ray cluster ({e})") from None


def reclaim_sigterm() -> None:
    """Take SIGTERM back from Ray, in the main thread after `connect`. The driver's core worker
    installs absl's failure-signal handler for SIGTERM: it prints a stack, passes the signal on to
    the handler it replaced (ours: the orderly teardown), and arms alarm(3), so a driver that
    survives the signal is aborted (exit 134) three seconds later, in the middle of its teardown.
    Re-installing our own handler at the OS level takes absl's out of the chain."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """An explicit HOST:PORT must accept a TCP connection: ray.init would otherwise retry for minutes."""
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"cluster.ray_address={address!r}: expected 'auto' or HOST:PORT of the Ray head (GCS)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(f"cluster.ray_address={address!r}: nothing accepts connections there ({e}); "
                           "is the Ray head started (ray start --head) and the address right?") from None


def gpu_nodes(min_gpus: int) -> list[dict[str, Any]]:
    """Alive nodes with >= min_gpus GPUs: the driver's node first, then by (IP, node id)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= min_gpus]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))


def _describe(min_gpus: int) -> str:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    seen = ", ".join(f"{n['NodeManagerAddress']}: {int(n.get('Resources', {}).get('GPU', 0))} GPU" for n in alive)
    return f"{len(alive)} alive node(s) [{seen}]"


def wait_for_nodes(
    nodes: int, gpus_per_node: int, timeout_s: float = 600.0, poll_s: float = 2.0
) -> list[dict[str, Any]]:
    """Block until `nodes` nodes with >= gpus_per_node GPUs are alive; return them (ordered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = gpu_nodes(gpus_per_node)
        if len(found) >= nodes:
            return found[:nodes]
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"the Ray cluster has {len(found)} node(s) with >= {gpus_per_node} GPUs after {timeout_s:g} s; "
                f"cluster.nodes={nodes} x cluster.gpus_per_node={gpus_per_node} are needed ({_describe(gpus_per_node)})"
            )
        time.sleep(poll_s)


def reserve(plan: Plan, nodes: list[dict[str, Any]], timeout_s: float = 300.0) -> list[Any]:
    """One STRICT_PACK placement group per plan node, pinned to nodes[i]; waits until all are placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    g = plan.cfg.cluster.gpus_per_node
    pgs = []
    for i, node in enumerate(nodes):
        bundles = [{"GPU": 1.0, "CPU": CPUS_PER_BUNDLE} for _ in range(g)]
        pgs.append(placement_group(bundles, strategy="STRICT_PACK", name=f"mlrl-node{i}",
                                   bundle_label_selector=[{NODE_ID_LABEL: node["NodeID"]}] * g))
    ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if pending:
        for pg in pgs:
            remove_placement_group(pg)
        raise ClusterError(
            f"{len(pending)} of {len(pgs)} node reservations ({g} GPUs + {g * CPUS_PER_BUNDLE:g} CPUs each) "
            f"were not placed within {timeout_s:g} s: GPUs/CPUs already taken by another job?"
        )
    return pgs


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def probe(plan: Plan, pgs: list[Any], timeout_s: float = 120.0) -> list[NodeInfo]:
    """Node IP, physical GPU id per bundle, and free ports, for every plan node."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def _probe(ports: int) -> tuple[str, str, int, list[int]]:
        ctx = ray.get_runtime_context()
        ids = ray.get_gpu_ids()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), int(ids[0]), _free_ports(ports)

    need = ports_needed(plan)
    g = plan.cfg.cluster.gpus_per_node
    refs = [[_probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b))
             .remote(need[i] if b == 0 else 0) for b in range(g)] for i, pg in enumerate(pgs)]
    out = []
    for i, node_refs in enumerate(refs):
        results = ray.get(node_refs, timeout=timeout_s)
        node_ids = {r[0] for r in results}
        if len(node_ids) != 1:
            raise ClusterError(f"plan node {i}: its placement group spans {len(node_ids)} Ray nodes (expected one)")
        out.append(NodeInfo(i, results[0][0], results[0][1], tuple(r[2] for r in results), tuple(results[0][3])))
    return out


def join_cluster(cfg: Config, plan: Plan, *, wait_s: float = 600.0, reserve_s: float = 300.0) -> ClusterAssignment:
    """Steps 1-5 of the module docstring; the caller owns the result and must `release` it."""
    if plan.cpu:
        raise ClusterError("cluster.gpus_per_node=0: --nodes needs a GPU cluster")
    if not plan.fits:
        raise ClusterError("the plan does not fit: " + "; ".join(plan.reasons))
    c = cfg.cluster
    connect(c.ray_address)
    nodes = wait_for_nodes(c.nodes, c.gpus_per_node, timeout_s=wait_s)
    pgs = reserve(plan, nodes, timeout_s=reserve_s)
    try:
        result = assign(plan, probe(plan, pgs))
    except BaseException:
        release_groups(pgs)
        raise
    result.placement_groups = pgs
    return result


def release_groups(pgs: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in pgs:
        remove_placement_group(pg)


def release(assignment: ClusterAssignment) -> None:
    """Give the reserved GPUs back (the Ray connection stays up)."""
    release_groups(assignment.placement_groups)
    assignment.placement_groups = []
