"""Admission: which of a request's computed chunks the connector stores in the server, and when.

Why a module of its own: storing every computed chunk at once ("eager") is the policy the
field measured to hurt once the CPU tier is smaller than the live working set: each store
costs copies in vLLM's step, and the tier holds copies of what vLLM's own prefix cache still
holds (inclusive caching), so the chunks vLLM evicts are the ones it lacks. The other two
modes store less:
- "evict": a chunk is stored only when vLLM evicts its blocks. At the end of a request its
  unstored chunks are remembered with the prefix-cache hashes of their blocks. vLLM takes
  blocks for new KV only through its block pool's `get_new_blocks`, which pops the head of
  the free queue; the connector wraps that call on the pool instance (no vLLM file changes)
  and looks at the blocks about to be popped: a remembered chunk with one of them, whose
  hashes are still the ones it was remembered with, is stored before the forward of the step
  being scheduled (the workers run these stores when the step's metadata is bound). Why the
  bytes are right: the chunk was whole when its block was taken, and nothing writes a newly
  taken block before the forward (vLLM zeroes or copies into new blocks only for hybrid or
  mixed-precision caches; those blocks, named in the step's output, are never stored). A
  chunk whose hashes changed first (its blocks reused in another way) is forgotten: a later
  miss, never wrong bytes. The cost is per block taken, not per step. The tier then holds
  what vLLM does not (exclusive caching). Needs vLLM's block pool (bound by vLLM through
  `bind_gpu_block_pool`) and prefix caching (the hashes); without them it stores as "eager"
  does, and says so once.
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
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from kvedit.vllm import hooks

logger = logging.getLogger("vllm.kvedit")

StoreMode = Literal["eager", "evict", "reuse"]
STORE_MODES: tuple[str, ...] = ("eager", "evict", "reuse")


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
        self.taken: list[Deferred] = []        # remembered chunks whose blocks were just taken
        self.take_s = 0.0                      # time spent looking at taken blocks
        self.max_deferred = max_deferred
        self.deferred: OrderedDict[bytes, Deferred] = OrderedDict()  # by rank-0 key
        self.by_block: dict[int, set[bytes]] = {}
        self.dropped = self.stored_at_evict = 0   # chunks whose blocks were reused first
        self.dropped_at_reset = 0                  # chunks forgotten when vLLM reset its cache
        self._table = None                         # the pool's hash table when last seen
        self._warned = False

    # ---- set-up ------------------------------------------------------------------------
    def bind_pool(self, pool) -> None:
        """vLLM's block pool (scheduler side): in evict mode, wrap its get_new_blocks."""
        if self.mode != "evict" or not all(hasattr(pool, a) for a in (
                "free_block_queue", "blocks", "get_new_blocks")):
            return
        self.pool = pool
        self._table = getattr(pool, "cached_block_hash_to_block", None)

        def wrap(take):
            def get_new_blocks(num_blocks: int):
                if self.deferred and num_blocks > 0:
                    self._taking(num_blocks)
                return take(num_blocks)
            return get_new_blocks

        hooks.shadow(pool, "get_new_blocks", "BlockPool.get_new_blocks", wrap)

    @property
    def defers(self) -> bool:
        """Whether stores wait for eviction (evict mode with what it needs)."""
        if self.mode != "evict":
            return False
        if self.pool is None or not getattr(self.pool, "enable_caching", False):
            if not self._warned:
                self._warned = True
                logger.warning("kvedit connector: store 'evict' needs vLLM's block pool and "
                               "prefix caching (--enable-prefix-caching); "
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
        self._check_reset()   # before remembering: a reset seen later would forget these
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
    def _taking(self, n: int) -> None:
        """get_new_blocks is about to pop the first `n` free blocks: the remembered chunks
        with one of them are taken now (stored before this step's forward) if still whole,
        forgotten if not. This runs inside vLLM's scheduler for every allocation: one dict
        lookup per block, one hash compare per chunk."""
        t0 = time.perf_counter()
        self._check_reset()
        queue, by_block = self.pool.free_block_queue, self.by_block
        block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
        for _ in range(n):
            if block is None or block is tail or not by_block:
                break
            keys = by_block.get(block.block_id)
            if keys:
                for key in list(keys):
                    d = self._forget(key)
                    if self._valid(d):
                        self.taken.append(d)
                    else:
                        self.dropped += 1
            block = block.next_free_block
        self.take_s += time.perf_counter() - t0

    def due(self, unsafe_blocks: set[int]) -> list[Deferred]:
        """Remembered chunks this step's schedule took: store them before this step's
        forward. `unsafe_blocks`: blocks vLLM zeroes or copies into before the forward
        (their chunks are dropped)."""
        self._check_reset()
        out: list[Deferred] = []
        for d in self.taken:
            if unsafe_blocks.isdisjoint(d.blocks):
                out.append(d)
            else:
                self.dropped += 1
        self.taken = []
        self.stored_at_evict += len(out)
        return out

    def _check_reset(self) -> None:
        """vLLM's reset_prefix_cache (after a weight update in RL, or between benchmark
        phases) replaces the pool's hash table and clears every block's hash: the KV of the
        remembered chunks is no longer vLLM's cache (after a weight update it is stale), so
        they are forgotten, not stored (they would only be forgotten one by one as their
        blocks are taken)."""
        table = getattr(self.pool, "cached_block_hash_to_block", None)
        if table is self._table:
            return
        self._table = table
        if self.deferred:
            logger.info("kvedit connector: vLLM reset its prefix cache; %d remembered chunks "
                        "forgotten (store mode 'evict' stores what vLLM evicts, and a reset "
                        "is no eviction)", len(self.deferred))
        self.dropped_at_reset += len(self.deferred) + len(self.taken)
        self.deferred.clear()
        self.by_block.clear()
        self.taken = []

    def _valid(self, d: Deferred) -> bool:
        blocks_of = self.pool.blocks   # one list compare: this runs per chunk taken
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
