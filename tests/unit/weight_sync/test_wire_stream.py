"""The broadcast wire protocol over real gloo groups (threads of this process): K senders x W
receivers, every dtype, checksums and digests, fail-fast on a broken stream, and the benchmark's
raw-broadcast reference (tools/weight_sync_reference.py) over the same groups."""

import threading
import uuid

import pytest
import torch
from helpers.tools import load_tool

from mlrl.weight_sync.receiver import Receiver
from mlrl.weight_sync.sender import bucketize, push_from_rank
from mlrl.weight_sync.source import PushRequest
from mlrl.weight_sync.transports import close_channels
from mlrl.weight_sync.wire import (
    PACK_MAX_BYTES,
    PROTOCOL,
    Digest,
    GroupSpec,
    WireError,
    checksum,
    join_as_receiver,
    join_as_sender,
    open_store,
    plan_units,
)

reference = load_tool("weight_sync_reference")  # tools/bench_weight_sync.py's raw-broadcast reference


def _spec(store, k, w, timeout_s=30.0) -> GroupSpec:
    return GroupSpec("127.0.0.1", store.port, uuid.uuid4().hex[:8], k, w, "gloo", timeout_s)


def _run(fns, timeout=60):
    errors, results = [], [None] * len(fns)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:
            errors.append(e)
            results[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a member is stuck"
    return results, errors


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(17, 8, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g).to(torch.float16)),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(6, 4, generator=g).t()),  # non-contiguous
    ]


def test_two_senders_to_two_receivers_every_dtype():
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 2, 2)
    sent = {0: _weights(0), 1: [(f"s1.{n}", t) for n, t in _weights(1)]}
    got = {0: [], 1: []}

    def sender(s):
        ch = join_as_sender(spec, s)
        d = Digest()
        for bucket in bucketize(iter(sent[s]), bucket_bytes=300):
            ch.send_bucket(bucket, d)
        ch.send_end(d)
        return d.hexdigest()

    def receiver(r):
        rec = Receiver()
        rec.join(spec.to_json(), r)
        rep = rec.receive({"transport": "broadcast", "session": spec.session, "version": 5},
                          lambda bucket: got[r].extend((n, t.clone()) for n, t in bucket))
        rec.close()
        return rep

    results, errors = _run([lambda: sender(0), lambda: sender(1), lambda: receiver(0), lambda: receiver(1)])
    assert not errors, errors
    digests = results[:2]
    for r, rep in zip((0, 1), results[2:]):
        assert rep["transport"] == "broadcast" and rep["version"] == 5
        assert [s["digest"] for s in rep["streams"]] == digests
        assert [s["tensors"] for s in rep["streams"]] == [len(sent[0]), len(sent[1])]
        expect = sent[0] + sent[1]
        assert [n for n, _ in got[r]] == [n for n, _ in expect]
        for (_, a), (_, b) in zip(got[r], expect):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
def test_checksum_mismatch_is_detected(verify):
    """weight_sync.verify_checksums (the receivers' `verify`): on, a mismatch fails the sync; off, the
    receiver compares no checksum and takes the bytes as they came."""
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 1, 1)
    t = torch.arange(10, dtype=torch.float32)

    def sender():
        ch = join_as_sender(spec, 0)
        ch._send_header({"p": PROTOCOL, "end": False, "tensors": [{"name": "w", "dtype": "float32", "shape": [10]}],
                         "units": [[0]]})
        ch._bcast(t.view(torch.uint8))
        ch._send_header({"p": PROTOCOL, "checksums": [checksum(t + 1)]})  # what the sender claims it sent
        if not verify:  # the receiver reads on: the stream's end, as the sender's digest records it
            d = Digest()
            d.add("w", checksum(t + 1), t.numel() * t.element_size())
            ch.send_end(d)

    def receiver():
        ch = join_as_receiver(spec, 0)[0]
        d = Digest()
        return [b for b in ch.recv_stream(d, verify=verify)], d

    results, errors = _run([sender, receiver])
    if verify:
        assert len(errors) == 1 and isinstance(errors[0], WireError) and "checksum mismatch for w" in str(errors[0])
        return
    assert not errors, errors
    [[(name, got)]], digest = results[1]
    assert name == "w" and torch.equal(got, t) and digest.tensors == 1


def test_small_tensors_share_a_broadcast_large_ones_go_alone_and_all_arrive_exactly():
    big = PACK_MAX_BYTES // 4  # float32 elements of a tensor at the packing limit
    assert plan_units([4, 40, big * 4, 6, 7, 0]) == [[0, 1], [2], [3, 4, 5]]
    assert plan_units([]) == []
    g = torch.Generator().manual_seed(3)
    named = [("norm.a", torch.randn(3, generator=g)), ("norm.b", torch.randn(5, generator=g).to(torch.float16)),
             ("big", torch.randn(big + 1, generator=g)), ("flag", torch.tensor([True, False])),
             ("bias", torch.randn(7, generator=g).to(torch.bfloat16))]
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 1, 1)
    sends = []

    def sender():
        ch = join_as_sender(spec, 0)
        bcast = ch._bcast_async
        ch._bcast_async = lambda t: (sends.append(t.numel()), bcast(t))[1]
        d = Digest()
        ch.send_bucket(named, d)
        ch.send_end(d)

    def receiver():
        ch = join_as_receiver(spec, 0)[0]
        return list(ch.recv_stream(Digest()))

    results, errors = _run([sender, receiver])
    assert not errors
    ((got,),) = [results[1]]
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, named))
    # header, trailer and end header are two broadcasts each; the payload is 3: [norm.a, norm.b], [big], [flag, bias]
    assert len(sends) == 2 + 3 + 2 + 2 and (big + 1) * 4 in sends


def test_a_header_whose_units_do_not_cover_its_tensors_is_refused():
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 1, 1)

    def sender():
        ch = join_as_sender(spec, 0)
        ch._send_header({"p": PROTOCOL, "end": False, "units": [[0]],
                         "tensors": [{"name": n, "dtype": "float32", "shape": [2]} for n in ("a", "b")]})

    def receiver():
        ch = join_as_receiver(spec, 0)[0]
        return list(ch.recv_stream(Digest()))

    results, errors = _run([sender, receiver])
    assert len(errors) == 1 and isinstance(errors[0], WireError) and "do not cover tensors 0..1" in str(errors[0])


def test_sender_failure_tears_the_group_down_and_receivers_fail_fast():
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 1, 1, timeout_s=20)

    def bad_buckets(bucket_bytes):
        yield [("a", torch.ones(4))]
        raise RuntimeError("bridge failed on layer 3")

    def sender():
        return push_from_rank(PushRequest("broadcast", 1, group=spec.to_json()), bad_buckets, 0)

    def receiver():
        rec = Receiver()
        rec.join(spec.to_json(), 0)
        try:
            return rec.receive({"transport": "broadcast", "session": spec.session}, lambda b: None)
        finally:
            assert rec.channels == [] and rec.session is None  # a failed stream leaves the group: the driver re-joins

    import time
    t0 = time.monotonic()
    results, errors = _run([sender, receiver], timeout=30)
    assert any("bridge failed" in str(e) for e in errors)
    assert isinstance(results[1], Exception)  # the receiver did not hang until the group timeout
    assert time.monotonic() - t0 < 15
    close_channels()


def test_raw_broadcast_and_non_senders():
    store = open_store("127.0.0.1", 0, 30)
    spec = _spec(store, 1, 1)
    calls = []

    def buckets(n):
        calls.append(n)
        return iter([[("x", torch.ones(3))]])

    assert push_from_rank(PushRequest("broadcast", 1, bucket_bytes=123), buckets, None) is None
    assert calls == [123]  # a non-sending rank still iterates (trainer-side collectives stay aligned)

    def sender():
        return reference.send_raw(spec.to_json(), [1000, 10, 5000], 0)

    def receiver():
        rec = Receiver()
        rec.join(spec.to_json(), 0)
        return reference.on_worker(rec, {"op": "raw", "sizes": [1000, 10, 5000]})

    results, errors = _run([sender, receiver])
    assert not errors and results[0] == 6010 and results[1]["bytes"] == 6010
    close_channels()


def test_checksums_name_their_algorithm_and_catch_corruption():
    t = torch.randn(3 * 8192 * 2 + 5)  # several 64 KiB blocks plus an odd tail
    c = checksum(t)
    assert c.startswith("bsum64:") and c == checksum(t.clone())
    flipped = t.clone()
    flipped.view(torch.int32)[12345] ^= 1  # one bit
    swapped = t.clone().view(-1)
    a, b = swapped[:16384].clone(), swapped[16384:32768].clone()
    swapped[:16384], swapped[16384:32768] = b, a  # two 64 KiB blocks exchanged
    for bad in (flipped, swapped, t[:-1], torch.zeros_like(t)):
        assert checksum(bad) != c
    odd = torch.arange(11, dtype=torch.uint8)[3:]  # unaligned storage offset
    assert checksum(odd) == checksum(odd.clone())
    assert checksum(t, "crc32").startswith("crc32:") and checksum(t, "crc32") != checksum(flipped, "crc32")
    with pytest.raises(WireError):
        checksum(t, "md5")


def test_a_failed_send_walks_the_rest_of_its_buckets_so_tp_peers_finish(monkeypatch):
    """The sender's TP / EP peers gather their share of every tensor while the sender streams: when
    its transport fails (an engine died mid-broadcast, a full disk), the sender must still walk the
    rest of its iterator, or its peers wait out the process group's timeout (30 min) in their next
    collective and the driver cannot retry. Stands in for the collectives by counting the buckets
    each rank's iterator produced."""
    from mlrl.weight_sync import sender as sender_mod

    produced: list[int] = []

    def buckets(bucket_bytes):
        for i in range(5):
            produced.append(i)  # in the real iterator: the all-gathers of this bucket's tensors
            yield [(f"w{i}", torch.zeros(2))]

    class Failing:
        release = None

        @staticmethod
        def send(req, sender, bucket_fn, digest, rep):
            for i, _ in enumerate(bucket_fn(req.bucket_bytes)):
                if i == 1:
                    raise OSError("engine-0 went away")

    monkeypatch.setattr(sender_mod, "transport", lambda name: Failing)
    with pytest.raises(OSError, match="engine-0 went away"):
        push_from_rank(PushRequest("disk", 1), buckets, 0)
    assert produced == [0, 1, 2, 3, 4]  # the peers' five gathers are met, once each

    class FailingFirst:  # (joining the group failed before any bucket)
        release = None

        @staticmethod
        def send(req, sender, bucket_fn, digest, rep):
            raise ConnectionError("no store")

    produced.clear()
    monkeypatch.setattr(sender_mod, "transport", lambda name: FailingFirst)
    with pytest.raises(ConnectionError):
        push_from_rank(PushRequest("disk", 1), buckets, 0)
    assert produced == [0, 1, 2, 3, 4]
