"""Admission: which of a request's computed chunks the connector stores in the server, and when.

Why a module of its own: storing every computed chunk at once ("eager") is the policy the
field measured to hurt once the CPU tier is smaller than the live working set: each store
costs copies in vLLM's step, and the tier holds copies of what vLLM's own prefix cache still
holds (inclusive caching), so the chunks vLLM evicts are the ones it lacks. The other two
modes store less:
- "evict": a chunk is stored only when vLLM is about to evict its blocks. At the end of a
  request its unstored chunks are remembered with the prefix-cache hashes of their blocks;
  each step, those whose blocks sit within reach of the next allocations at the head of
  vLLM's free-block queue (twice the blocks this step takes) are stored. Why the bytes are
  right: a block still holding its hash when the step's metadata is built was not allocated
  by this step's schedule, so this step's forward does not write it, and the store reads it
  after that forward, before the next step's forward can. A chunk whose block was reused
  first (its hash reset: other tokens now) is dropped, never stored; a reach too short
  costs such drops (misses later), never wrong bytes. The tier then
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
                 max_seen: int = 1 << 18, max_deferred: int = 1 << 16):
        self.mode, self.block_size, self.chunk = mode, block_size, chunk
        self.seen = SeenKeys(max_seen)
        self.pool = None                       # vLLM's BlockPool (bind_pool), evict mode
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
    def due(self, scheduled_tokens: int, scheduled_reqs: int) -> list[Deferred]:
        """Remembered chunks to store in this step: those with a block among the blocks
        vLLM will allocate next (the head of its free queue, as far as twice what this step
        took: `scheduled_tokens` of `scheduled_reqs` requests), still holding the tokens
        they held (same prefix-cache hash). Ones whose blocks were reused are dropped."""
        if not self.deferred:
            return []
        reach = 2 * max(-(-scheduled_tokens // self.block_size) + scheduled_reqs,
                        self.chunk // self.block_size)
        out: list[Deferred] = []
        queue = self.pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        for _ in range(reach):
            if block is None or block is tail:
                break
            for key in list(self.by_block.get(block.block_id, ())):
                d = self._forget(key)
                if self._valid(d):
                    out.append(d)
                else:
                    self.dropped += 1
            block = block.next_free_block
        self.stored_at_evict += len(out)
        return out

    def _valid(self, d: Deferred) -> bool:
        blocks_of = self.pool.blocks
        return all(blocks_of[b].block_hash == h for b, h in zip(d.blocks, d.hashes))

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
