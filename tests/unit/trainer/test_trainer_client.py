"""The driver's typed trainer clients: every call names a real `TrainerService` method (passed as
the function, never a string), with keyword arguments that bind to that method's signature, and
`TrainerGroup.call` refuses anything else before sending a byte."""

import inspect
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from mlrl.experience.batch import MicroBatch
from mlrl.interfaces import Critic, Policy
from mlrl.trainer.driver.client import CriticClient, MegatronWeightSource, TrainerClient
from mlrl.trainer.driver.group import TrainerGroup
from mlrl.trainer.rank.service import TrainerService
from mlrl.trainer.rpc import recv, send
from mlrl.weight_sync.source import PushRequest


class RecordingGroup:
    """Stands in for TrainerGroup: checks each call against the service method's signature."""

    def __init__(self, dp_ranks=(0, 1), pp_ranks=(0, 0)):
        self.rank_info = [{"dp_rank": d, "pp": p} for d, p in zip(dp_ranks, pp_ranks)]
        self.calls = []

    def call(self, method, /, *args, **kwargs):
        return self._record(method, None, args, kwargs)

    def call_sharded(self, method, per_rank, /, *args, **kwargs):
        assert len(per_rank) == len(self.rank_info)
        return self._record(method, per_rank, args, kwargs)

    def _record(self, method, per_rank, args, kwargs):
        assert getattr(TrainerService, method.__name__) is method
        for r in range(len(self.rank_info)):
            head = (per_rank[r],) if per_rank is not None else ()
            inspect.signature(method).bind(object(), *head, *args, **kwargs)  # raises TypeError on a mismatch
        self.calls.append((method.__name__, per_rank, kwargs))
        if method is TrainerService.push_weights:  # only stage senders report; none here
            return [None] * len(self.rank_info)
        return [f"rank{r}" for r in range(len(self.rank_info))]


def _mb(tag):
    z = torch.zeros(2)
    return MicroBatch(tokens=torch.tensor([tag, tag]), position_ids=z.long(), cu_seqlens=torch.tensor([0, 2]),
                      sample_ids=z.long(), loss_mask=z, loss_weight=z, advantages=z, rollout_logprobs=z)


def test_every_client_method_binds_to_the_service_method_it_mirrors(tmp_path):
    g = RecordingGroup()
    t, c = TrainerClient(g), CriticClient(TrainerClient(g))
    per_dp = [[_mb(0)], [_mb(1)]]
    assert t.compute_logprobs(per_dp, 1.0, reference=True) == ["rank0", "rank1"]  # one result per DP rank
    t.update(per_dp)
    t.save_checkpoint(tmp_path / "a", critic_path=tmp_path / "c")
    t.load_checkpoint(tmp_path / "a")
    t.finalize_checkpoints(blocking=False)
    t.export_hf(tmp_path / "hf")
    c.compute_values(per_dp)
    c.update(per_dp)
    assert MegatronWeightSource(t).push(PushRequest("disk", 3, disk_dir=str(tmp_path))) == []
    names = [name for name, *_ in g.calls]
    assert names == ["compute_logprobs", "update", "save_checkpoint", "load_checkpoint", "finalize_checkpoints",
                     "export_hf", "compute_values", "update_critic", "push_weights"]
    # each rank got its own DP rank's micro-batches
    per_rank = g.calls[1][1]
    assert [int(mbs[0].tokens[0]) for mbs in per_rank] == [0, 1]
    for proto, obj in ((Policy, t), (Critic, c)):
        missing = [m for m in dir(proto) if not m.startswith("_") and not hasattr(obj, m)]
        assert not missing, f"{type(obj).__name__} lacks {missing} of {proto.__name__}"


def test_wrong_dp_count_is_refused():
    t = TrainerClient(RecordingGroup())
    with pytest.raises(ValueError, match="micro-batches for 1 DP ranks, the trainer has dp=2"):
        t.update([[_mb(0)]])


def _group_over_pipes(n):
    """A TrainerGroup wired to in-process pipes instead of rank processes (no torchrun)."""
    g = TrainerGroup.__new__(TrainerGroup)
    ends = [Pipe() for _ in range(n)]
    g._conns = [a for a, _ in ends]
    g._procs = None
    g._call_lock = threading.RLock()
    return g, [b for _, b in ends]


def test_calls_from_two_threads_do_not_interleave_on_the_connections():
    """The loop's train phase and a restarted engine's weight refresh call the ranks from different
    threads: each call's requests and replies stay together (interleaved, a rank would answer the
    other call's request, or two collectives would cross)."""
    g, ranks = _group_over_pipes(2)
    log = []

    def rank(conn, r):
        for _ in range(2):
            name, kwargs = recv(conn)
            log.append((r, "recv", kwargs["blocking"]))
            time.sleep(0.05)  # a slow call: another thread's request would arrive meanwhile
            send(conn, ("ok", (r, kwargs["blocking"])))

    threads = [threading.Thread(target=rank, args=(c, r)) for r, c in enumerate(ranks)]
    for th in threads:
        th.start()
    out = {}
    callers = [threading.Thread(target=lambda b=b: out.__setitem__(b, g.call(TrainerService.finalize_checkpoints,
                                                                             blocking=b))) for b in (True, False)]
    for th in callers:
        th.start()
    for th in (*callers, *threads):
        th.join(5)
    assert out == {True: [(0, True), (1, True)], False: [(0, False), (1, False)]}
    first = log[0][2]  # every rank saw one call's request before the other's
    assert [b for r, _, b in log if r == 0] == [b for r, _, b in log if r == 1] == [first, not first]


def test_in_call_tells_whether_another_thread_is_in_a_trainer_call():
    """SIGTERM's teardown asks before committing a pending checkpoint: a train phase left running in
    its thread holds the call lock, and a commit behind it would outlast Slurm's KillWait."""
    g, ranks = _group_over_pipes(1)
    started, release = threading.Event(), threading.Event()

    def rank(conn):
        recv(conn)
        started.set()
        release.wait(5)
        send(conn, ("ok", 1))

    rank_thread = threading.Thread(target=rank, args=(ranks[0],))
    rank_thread.start()
    assert not g.in_call()
    caller = threading.Thread(target=lambda: g.call(TrainerService.finalize_checkpoints, blocking=True))
    caller.start()
    assert started.wait(5) and g.in_call()
    release.set()
    caller.join(5)
    rank_thread.join(5)
    assert not g.in_call()


def test_group_sends_the_method_name_and_refuses_non_service_callables():
    g, ranks = _group_over_pipes(2)
    seen = []

    def rank(conn, r):
        name, kwargs = recv(conn)
        seen.append((r, name, kwargs))
        send(conn, ("ok", r * 10))

    threads = [threading.Thread(target=rank, args=(c, r)) for r, c in enumerate(ranks)]
    for th in threads:
        th.start()
    assert g.call(TrainerService.finalize_checkpoints, blocking=True) == [0, 10]
    for th in threads:
        th.join(5)
    assert sorted(seen) == [(r, "finalize_checkpoints", {"blocking": True}) for r in (0, 1)]

    def update(micro_batches):  # same name, not the service's method
        return None

    for bad in (update, TrainerService._critic, "update"):
        with pytest.raises((TypeError, AttributeError)):
            g.call(bad)
    assert not any(c.poll(0.05) for c in ranks)  # nothing was sent for the refused calls


def test_rank_side_service_has_no_public_method_the_client_does_not_reach():
    """The client mirrors the service: a public service method nobody calls is dead RPC surface."""
    client_src = Path(inspect.getsourcefile(TrainerClient)).read_text()
    public = [m for m, _ in inspect.getmembers(TrainerService, inspect.isfunction) if not m.startswith("_")]
    unreached = [m for m in public if f"TrainerService.{m}" not in client_src and m != "info"]
    assert not unreached, unreached


def test_group_binds_arguments_to_the_service_signature_before_sending():
    """`call` / `call_sharded` bind their arguments to the service method's signature on the
    driver: a misspelt or extra argument, or per-rank micro-batches for the wrong number of ranks,
    fails there and no rank sees a request."""
    g, ranks = _group_over_pipes(2)
    with pytest.raises(TypeError, match="blocked"):
        g.call(TrainerService.finalize_checkpoints, blocked=True)
    with pytest.raises(TypeError):
        g.call(TrainerService.export_hf, "a", "b")
    with pytest.raises(ValueError, match="micro-batches for 1 ranks, the trainer has 2"):
        g.call_sharded(TrainerService.update, [[_mb(0)]])
    with pytest.raises(TypeError):
        g.call_sharded(TrainerService.compute_logprobs, [[_mb(0)], [_mb(1)]], 1.0, temperature=1.0)
    assert not any(c.poll(0.05) for c in ranks)


def test_sharded_call_sends_each_rank_its_micro_batches_and_the_shared_arguments_by_name():
    g, ranks = _group_over_pipes(2)
    seen = {}

    def rank(conn, r):
        name, kwargs = recv(conn)
        seen[r] = (name, kwargs)
        send(conn, ("ok", [(torch.zeros(1), torch.zeros(1))]))

    threads = [threading.Thread(target=rank, args=(c, r)) for r, c in enumerate(ranks)]
    for th in threads:
        th.start()
    g.call_sharded(TrainerService.compute_logprobs, [[_mb(3)], [_mb(4)]], 0.7, reference=True)
    for th in threads:
        th.join(5)
    assert {r: (name, sorted(kw)) for r, (name, kw) in seen.items()} == {
        r: ("compute_logprobs", ["micro_batches", "reference", "temperature"]) for r in (0, 1)}
    assert [int(seen[r][1]["micro_batches"][0].tokens[0]) for r in (0, 1)] == [3, 4]
    assert seen[0][1]["temperature"] == 0.7 and seen[1][1]["reference"] is True


def test_no_service_result_type_is_defined_in_the_service_module():
    """The service module runs as `__main__` on the ranks (`python -m mlrl.trainer.rank.service`):
    a class defined there would pickle as `__main__.<name>`, which the driver cannot unpickle
    (this broke router replay once). Every class a public method returns must live elsewhere."""
    import typing

    import mlrl.trainer.rank.service as service_module

    def classes(tp):
        origin = typing.get_origin(tp)
        if origin is None:
            return [tp] if isinstance(tp, type) else []
        return [c for a in typing.get_args(tp) for c in classes(a)]

    bad = []
    for name, fn in inspect.getmembers(TrainerService, inspect.isfunction):
        if name.startswith("_"):
            continue
        ret = typing.get_type_hints(fn, vars(service_module)).get("return")
        bad += [f"{name} -> {c.__qualname__}" for c in classes(ret) if c.__module__ == service_module.__name__]
    assert not bad, bad
    # and the one that did: its class pickles by a name the driver can import
    from mlrl.trainer.rpc import RankRouterDiagnostics

    assert typing.get_type_hints(TrainerService.router_diagnostics)["return"] is RankRouterDiagnostics


def test_a_call_interrupted_before_its_replies_leaves_the_group_refusing_calls(monkeypatch):
    """SIGTERM raised inside an SFT run's trainer call (or Ctrl-C) leaves its replies unread: the next
    call would read them as its own (a teardown's checkpoint commit, for one)."""
    from mlrl.trainer.driver import group as group_mod
    from mlrl.trainer.driver.group import TrainerError

    g, ranks = _group_over_pipes(1)

    def interrupted(conn, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(group_mod, "recv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        g.call(TrainerService.finalize_checkpoints, blocking=True)
    monkeypatch.undo()
    with pytest.raises(TrainerError, match="an earlier trainer call was interrupted"):
        g.call(TrainerService.finalize_checkpoints, blocking=False)
