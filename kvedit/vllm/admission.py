"""Admission: which of a request's computed chunks the connector stores in the server, and when.

Why a module of its own: storing every computed chunk at once ("eager") is the policy the
field measured to hurt once the CPU tier is smaller than the live working set: each store
costs copies in vLLM's step, and the tier holds copies of what vLLM's own prefix cache still
holds (inclusive caching), so the chunks vLLM evicts are the ones it lacks. The other two
modes store less:
- "evict": a chunk is stored only when vLLM evicts its blocks. At the end of a request its
  unstored chunks are remembered with the prefix-cache hashes of their blocks. Each step the
  chunks with a block among the first blocks of vLLM's free queue (as many as one schedule
  can take) are watched; at the next step, a watched chunk whose hash is gone had its block
  taken by that step's schedule, and is stored before that step's forward (the workers run
  these stores when the step's metadata is bound, before the forward writes the block). Why
  the bytes are right: the chunk was valid when last watched, so its block held its tokens'
  KV until this schedule took it, and nothing writes a newly taken block before the forward
  (vLLM zeroes or copies into new blocks only for hybrid or mixed-precision caches; those
  blocks, named in the step's output, are never stored). A chunk taken while not watched
  (a schedule taking more than one step's worth) is dropped: a later miss, never wrong bytes. The tier then
  holds what vLLM does not (exclusive caching). Needs vLLM's block pool (bound by vLLM
  >= 0.32 through `bind_gpu_block_pool`) and prefix caching (the hashes); without them it
  stores as "eager" does, and says so once.
- "reuse": a chunk is stored on its second sight: a bounded table counts the requests whose
  tokens covered each chunk key (prompt chunks at lookup, later chunks as they complete);
  since keys are prefix hashes, the chunks seen twice are a leading run. A prefix seen once
  (no reuse) is never stored: no copies at all.
Planning the store of a run of chunks is the scheduler side's; this module only says how far
a request's chunks may be stored now (`storable`) and which remembered chunks are due
(`due`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger("vllm.kvedit")

StoreMode = Literal["eager", "evict", "reuse"]
STORE_MODES: tuple[str, ...] = ("eager", "evict", "reuse")
# kv_transfer_params key a request sets to "eager" to have its chunks stored as computed in
# any mode (the SDK does: its edits read them next). One definition for both sides.
STORE_ASK = "kvedit_store"


@dataclass(slots=True)
class Deferred:
    """A chunk of a finished request, kept until vLLM is about to evict its blocks."""
    req_id: str
    index: int                  # chunk index in its request
    keys: list[bytes]           # its key on each tensor-parallel rank
    block_ids: list[int]        # the request's block ids (chunk index -> blocks)
    blocks: list[int]           # this chunk's own blocks
    hashes: list[object]        # their prefix-cache hashes when the request ended


class SeenKeys:
    """How many requests covered each chunk key (bounded: the least recently seen go)."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self._count: OrderedDict[bytes, int] = OrderedDict()

    def sight(self, keys: list[bytes]) -> None:
        count = self._count
        for key in keys:
            count[key] = count.pop(key, 0) + 1
        while len(count) > self.max_keys:
            count.popitem(last=False)

    def leading(self, keys: list[bytes], times: int) -> int:
        """How many leading `keys` were seen at least `times` times."""
        n = 0
        for key in keys:
            if self._count.get(key, 0) < times:
                break
            n += 1
        return n


class Admission:
    """The store mode's decisions for the scheduler side (one instance per engine)."""

    def __init__(self, mode: StoreMode, block_size: int, chunk: int, *,
                 max_seen: int = 1 << 18, max_deferred: int = 1 << 16,
                 reach_blocks: int = 1024):
        self.mode, self.block_size, self.chunk = mode, block_size, chunk
        self.seen = SeenKeys(max_seen)
        self.pool = None                       # vLLM's BlockPool (bind_pool), evict mode
        self.reach = reach_blocks              # most blocks one schedule can take
        self.watch: set[bytes] = set()         # deferred keys near the free queue's head
        self.max_deferred = max_deferred
        self.deferred: OrderedDict[bytes, Deferred] = OrderedDict()  # by rank-0 key
        self.by_block: dict[int, set[bytes]] = {}
        self.dropped = self.stored_at_evict = 0   # chunks whose blocks were reused first
        self._warned = False

    # ---- set-up ------------------------------------------------------------------------
    def bind_pool(self, pool) -> None:
        """vLLM's block pool (scheduler side, vLLM >= 0.32)."""
        if hasattr(pool, "free_block_queue") and hasattr(pool, "blocks"):
            self.pool = pool

    @property
    def defers(self) -> bool:
        """Whether stores wait for eviction (evict mode with what it needs)."""
        if self.mode != "evict":
            return False
        if self.pool is None or not getattr(self.pool, "enable_caching", False):
            if not self._warned:
                self._warned = True
                logger.warning("kvedit connector: store 'evict' needs vLLM's block pool and "
                               "prefix caching (vLLM >= 0.32, --enable-prefix-caching); "
                               "storing every chunk as it is computed instead ('eager')")
            return False
        return True

    # ---- per request -------------------------------------------------------------------
    def sighted(self, keys: list[bytes]) -> None:
        """A request covers these chunk keys (rank 0), each counted once per request."""
        if self.mode == "reuse":
            self.seen.sight(keys)

    def storable(self, keys: list[bytes], stored: int, full: int) -> int:
        """How far [stored, full) of a request's chunks (rank-0 `keys` up to `full`) may be
        stored now: all (eager), none (evict: at eviction), the leading run seen twice
        (reuse)."""
        if self.mode == "reuse":
            return max(stored, self.seen.leading(keys[:full], 2))
        if self.defers:
            return stored
        return full

    def finished(self, req_id: str, keys: list[list[bytes]], stored: int, full: int,
                 block_ids: list[int]) -> list[Deferred]:
        """A request ended with chunks [stored, full) computed but not stored: remember them
        (evict mode) -> the ones pushed out by the table's bound (store them now if their
        blocks still hold them)."""
        if not self.defers or full <= stored:
            return []
        per = self.chunk // self.block_size
        blocks_of = self.pool.blocks
        for i in range(stored, full):
            own = block_ids[i * per:(i + 1) * per]
            if len(own) < per:
                break
            hashes = [blocks_of[b].block_hash for b in own]
            if any(h is None for h in hashes):   # not in the prefix cache: cannot revalidate
                break
            self._remember(Deferred(req_id, i, [k[i] for k in keys], block_ids, own, hashes))
        out = []
        while len(self.deferred) > self.max_deferred:
            d = self._forget(next(iter(self.deferred)))
            if self._valid(d):
                out.append(d)
        return out

    # ---- per step ----------------------------------------------------------------------
    def due(self, unsafe_blocks: set[int]) -> list[Deferred]:
        """Remembered chunks this step's schedule just evicted (watched last step, hash gone
        now): store them before this step's forward. `unsafe_blocks`: blocks vLLM zeroes or
        copies into before the forward (their chunks are dropped). Then watch the chunks
        with a block among the first `reach` blocks of the free queue."""
        if not self.deferred:
            self.watch = set()
            return []
        out: list[Deferred] = []
        whole: set[bytes] = set()   # watched last step and still valid: no second check below
        for key in self.watch:
            d = self.deferred.get(key)
            if d is None:
                continue
            if self._valid(d):
                whole.add(key)
                continue
            self._forget(key)
            if unsafe_blocks.isdisjoint(d.blocks):
                out.append(d)
            else:
                self.dropped += 1
        # This runs in the scheduler every step: a chunk has chunk / block_size blocks, often
        # all near the head, so each chunk's hashes are compared once, not once per block
        watch, seen = set(), set()
        by_block, deferred = self.by_block, self.deferred
        queue = self.pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        for _ in range(self.reach):
            if block is None or block is tail:
                break
            keys = by_block.get(block.block_id)
            if keys:
                for key in keys - seen:
                    seen.add(key)
                    if key in whole or self._valid(deferred[key]):
                        watch.add(key)
            block = block.next_free_block
        self.watch = watch
        self.stored_at_evict += len(out)
        return out

    def _valid(self, d: Deferred) -> bool:
        blocks_of = self.pool.blocks   # one list compare: this runs per watched chunk per step
        return [blocks_of[b].block_hash for b in d.blocks] == d.hashes

    def _remember(self, d: Deferred) -> None:
        key = d.keys[0]
        if key in self.deferred:
            self._forget(key)
        self.deferred[key] = d
        for b in d.blocks:
            self.by_block.setdefault(b, set()).add(key)

    def _forget(self, key: bytes) -> Deferred:
        d = self.deferred.pop(key)
        for b in d.blocks:
            keys = self.by_block.get(b)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_block[b]
        return d
