"""RayRanks (the trainer ranks on Ray node agents) when a node died: its agent's calls raise
RayActorError. Before, that error replaced the lost rank's TrainerError (log_tail runs inside its
report) and stopped the teardown (TrainerGroup.close -> wait / kill) before the placement was
released. A stand-in for `ray` (the real multi-node runs are tests/integration/cluster)."""

from types import SimpleNamespace

from mlrl.cluster.runtime import RayRanks


class ActorDied(Exception):  # stands in for ray.exceptions.RayActorError
    pass


def _agent(alive: bool, calls: list):
    def remote(name):
        def call(*args):
            calls.append(name)
            return (alive, name, args)
        return SimpleNamespace(remote=call)

    return SimpleNamespace(ranks_wait=remote("wait"), ranks_kill=remote("kill"), ranks_log_tail=remote("tail"))


class FakeRay:
    @staticmethod
    def get(ref, timeout=None):
        alive, name, args = ref
        if not alive:
            raise ActorDied("the actor died unexpectedly")
        return {"wait": True, "kill": None, "tail": "rank 0: step 3"}[name]


def test_a_dead_node_neither_hides_the_error_nor_stops_the_teardown():
    calls: list = []
    ranks = RayRanks.__new__(RayRanks)
    ranks._ray = FakeRay
    ranks._agents = {0: _agent(True, calls), 1: _agent(False, calls)}
    tail = ranks.log_tail(5)
    assert "rank 0: step 3" in tail and "(node 1: log unavailable, ActorDied: the actor died unexpectedly)" in tail
    assert ranks.wait(1.0) is True  # a dead node's ranks died with it
    ranks.kill()
    assert calls.count("kill") == 2  # the live node's ranks are killed too
