"""The kvedit tier in vLLM's own KV events: the chunks the server holds for this engine, as
BlockStored / BlockRemoved (medium "CPU") in the engine's event stream.

Why a module of its own: routers (llm-d's indexer, Dynamo's KV router, vLLM's router) route by
vLLM's KV events, which a connector joins through `KVConnectorBase_V1.take_events()`; its
events then go out under the engine's identity, beside vLLM's own GPU events. What the server
holds is known from the key watch (kvedit.client.key_watch: each chunk that becomes ready or
goes, and a fresh snapshot after a gap or a restart); what a chunk is in vLLM's terms (its
tokens, the prefix-cache hashes of its blocks, their parent, the extra keys that entered those
hashes) is known only while a request covering it is alive. This module joins the two: the
scheduler side describes a chunk when it plans its store or load (`describe`, `note`), and the
watch says when the chunk is there and when it goes.

What goes out (docs/connector.md, "KV events for routers"):
- a chunk is announced once while the server holds it on every TP rank: one BlockStored with
  its blocks' hashes, its tokens, the hash of the block before it and vLLM's block size
  (consecutive chunks of one request in one event, as vLLM does for its own blocks);
- it is removed, with exactly the hashes it was announced with, when the server evicts or
  deletes it (DELETE /cache and Unregister delete chunk by chunk), when a new snapshot lacks it
  (a lost push, a restarted server), or while the server is unreachable (the engine could not
  load it then); a later snapshot that shows it again announces it again;
- after vLLM clears its prefix cache, every chunk still held is announced again: routers apply
  vLLM's AllBlocksCleared (it has no medium) to every tier of the engine;
- at engine start one AllBlocksCleared goes out before the engine's first event, so a router
  forgets what it credited to an earlier life of this engine, whose removals this one cannot
  know. A kvedit server's restart is not told as AllBlocksCleared, for the same reason as above:
  routers would drop the engine's GPU blocks too; its chunks are removed one by one instead.
Which chunks are described at all (edited KV never as a plain prefix) is the scheduler side's.
Chunks described but not held are kept up to `max_pending`, the oldest forgotten first: a
forgotten chunk is one a router will not hear of, never a wrong one.
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvedit.vllm import hooks

try:  # the untagged per-block extra keys vLLM publishes (cache salt, LoRA name, media ids)
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )
except ImportError:  # older vLLM: the salt alone, on a request's first block, as it hashes it
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    generate_block_hash_extra_keys = to_event_extra_keys = None

logger = logging.getLogger("vllm.kvedit")

MEDIUM = "CPU"   # vLLM's name for host memory, the kvedit server's tier
_STORED_FIELDS = frozenset(BlockStored.__struct_fields__)   # fields vary across vLLMs
_REMOVED_FIELDS = frozenset(BlockRemoved.__struct_fields__)


@dataclass(slots=True, eq=False)
class Chunk:
    """One chunk in vLLM's terms, kept from its description until the server lets it go."""
    keys: tuple[bytes, ...]        # its key on each TP rank
    hashes: list                   # vLLM's prefix-cache hashes of its blocks
    parent: object                 # the hash of the block before it; None for the first
    tokens: array                  # its token ids (uint32)
    extra: list | None             # per block, as vLLM publishes them
    lora_id: int | None = None
    lora_name: str | None = None


def _extra_keys(request, start: int, per: int, block_size: int) -> list | None:
    """The extra keys that entered each block's hash, untagged as vLLM publishes them."""
    if generate_block_hash_extra_keys is None:
        salt = getattr(request, "cache_salt", None)
        return [(salt,)] + [None] * (per - 1) if start == 0 and salt else None
    keys, mm = [], 0
    for j in range(per):
        s = start + j * block_size
        k, mm = generate_block_hash_extra_keys(request, s, s + block_size, mm)
        keys.append(k)
    return to_event_extra_keys(keys)


class Vouched:
    """Rank-0 keys of chunks this engine computed from a prefix it can vouch for (bounded: the
    least recently added go first; a forgotten key is a chunk not announced, never a wrong
    one)."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, keys: list[bytes]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def leading(self, keys: list[bytes]) -> int:
        """How many leading `keys` are vouched for."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n


PLAIN = 1 << 62   # a request's taint when nothing it loaded was foreign


class TierEvents:
    """What this engine has told routers of the server's chunks, and what it will tell next.
    Single-threaded: the scheduler side calls it, and the key watch calls it from `sync()`."""

    def __init__(self, block_size: int, max_pending: int = 1 << 15, max_vouched: int = 1 << 18):
        self.block_size, self.max_pending = block_size, max_pending
        self.hash_scale = 1                    # vLLM's hash blocks per block (bind)
        self.vouched = Vouched(max_vouched)
        self.pending: OrderedDict[bytes, Chunk] = OrderedDict()   # by rank-0 key
        self.held: dict[bytes, Chunk] = {}                         # announced, by rank-0 key
        self.rank0: dict[bytes, bytes] = {}    # TP > 1: every other rank's key -> rank 0's
        self.watch = None                      # the key watch these chunks are checked in
        self.instance = None                   # the server the last whole snapshot came from
        self.pool = None
        self._table = None                     # vLLM's prefix-cache table when last seen
        self._out: list[dict] = []             # events not taken yet (merged as they come)
        self._clear_first = False              # AllBlocksCleared leads the first batch
        self.announced = self.removed = self.forgotten = 0

    # ---- set-up ------------------------------------------------------------------------
    def bind_pool(self, pool) -> None:
        """vLLM's block pool (bound before the engine's first step): one AllBlocksCleared
        ahead of its first event, in its own queue so it precedes vLLM's own events of that
        step; vLLM's prefix-cache resets are seen by its hash table being replaced."""
        self.pool = pool
        self._table = getattr(pool, "cached_block_hash_to_block", None)
        if not hooks.queue_kv_event(pool, AllBlocksCleared()):
            # not the queue we know: first among ours, after vLLM's events of that step
            self._clear_first = True

    def attach(self, watch) -> None:
        """A new key watch (a new connection to the server): it says what is held from its
        first whole snapshot on (keys_resynced)."""
        self.watch = watch

    # ---- what the scheduler side describes ---------------------------------------------
    def request_chunks(self, request, first: int, last: int, keys: list[list[bytes]],
                       chunk: int, computed: bool, taint: int) -> int:
        """Chunks [first, last) of vLLM's `request` (`keys`: per rank, from chunk 0) are
        stored from vLLM's blocks (`computed`) or loaded from the server -> the request's
        taint: the first chunk whose KV rests on KV this engine cannot vouch for (PLAIN:
        none). Which are described: those before the taint (this engine computed them, or
        computed what they were loaded from), and any chunk of a request with a cache salt
        (its hashes and its first block's extra keys carry the salt: a router credits it only
        to requests with that salt). So KV an edit stored under a request's plain keys is
        never announced as that plain prefix; docs/connector.md says why."""
        if computed:
            self.vouched.add(keys[0][first:min(last, taint)])
        else:
            n = self.vouched.leading(keys[0][first:last])
            if first + n < last:
                taint = min(taint, first + n)
        upto = last if getattr(request, "cache_salt", None) else min(last, taint)
        chunks = (self.describe(request, i, chunk, tuple(k[i] for k in keys))
                  for i in range(first, upto))
        self.note([c for c in chunks if c is not None])
        return taint

    def describe(self, request, index: int, chunk: int, keys: tuple[bytes, ...]) -> Chunk | None:
        """Chunk `index` of vLLM's `request` (its key on each rank: `keys`); None while vLLM
        has not hashed all its blocks."""
        per, scale = chunk // self.block_size, self.hash_scale
        first = index * per
        bh = request.block_hashes
        if len(bh) < (first + per) * scale:
            return None
        hashes = [bh[(first + j + 1) * scale - 1] for j in range(per)]
        parent = bh[first * scale - 1] if first else None
        start = index * chunk
        tokens = array("I", request.all_token_ids[start:start + chunk])
        lora = getattr(request, "lora_request", None)
        return Chunk(keys, hashes, parent, tokens,
                     _extra_keys(request, start, per, self.block_size),
                     lora.adapter_id if lora else None, lora.name if lora else None)

    def note(self, chunks: list[Chunk]) -> None:
        """Chunks this engine may announce: announced at once if the server holds them,
        else when the watch says it does."""
        for c in chunks:
            k0 = c.keys[0]
            if k0 in self.held:
                continue
            self.pending[k0] = c
            self.pending.move_to_end(k0)
            for k in c.keys[1:]:
                self.rank0[k] = k0
            if self._held_now(c):
                self._announce(c)
        while len(self.pending) > self.max_pending:
            _, c = self.pending.popitem(last=False)
            self._unmap(c)
            self.forgotten += 1

    # ---- what the key watch says (kvedit.client.key_watch.KeyListener) -------------------
    def keys_changed(self, added: dict[int, list[bytes]],
                     removed: dict[int, list[bytes]]) -> None:
        for rank, keys in removed.items():
            for k in keys:
                c = self.held.get(k if rank == 0 else self.rank0.get(k))
                if c is not None:
                    self._remove(c)
        for rank, keys in added.items():
            for k in keys:
                c = self.pending.get(k if rank == 0 else self.rank0.get(k))
                if c is not None and self._held_now(c):
                    self._announce(c)

    def keys_resynced(self, keys: dict[int, set[bytes]]) -> None:
        self.instance = self.watch.client.instance if self.watch is not None else None
        for c in list(self.held.values()):
            if not _held_in(c, keys):
                self._remove(c)
        for c in list(self.pending.values()):
            if _held_in(c, keys):
                self._announce(c)

    # ---- each step ---------------------------------------------------------------------
    def take(self, reachable: bool) -> list:
        """The events since the last call, as vLLM's structs. `reachable`: whether the
        server answers (while it does not, nothing of it is announced)."""
        watch = self.watch
        if self.held and (not reachable or (watch is not None and self.instance is not None
                                            and watch.client.instance != self.instance)):
            self._withdraw()   # unreachable, or restarted: its memory is gone
        table = getattr(self.pool, "cached_block_hash_to_block", None)
        if table is not self._table:   # vLLM reset its prefix cache (AllBlocksCleared)
            self._table = table
            for c in self.held.values():
                self._stored(c)
        out, self._out = self._out, []
        events = [_event(e) for e in out]
        if self._clear_first:
            self._clear_first = False
            events.insert(0, AllBlocksCleared())
        return events

    # ---- internals ---------------------------------------------------------------------
    def _held_now(self, c: Chunk) -> bool:
        w = self.watch
        return w is not None and w.trusted and _held_in(c, w.keys)

    def _announce(self, c: Chunk) -> None:
        k0 = c.keys[0]
        self.pending.pop(k0, None)
        self.held[k0] = c
        self.announced += 1
        self._stored(c)

    def _remove(self, c: Chunk) -> None:
        self.held.pop(c.keys[0], None)
        self._unmap(c)
        self.removed += 1
        self._removed(c)

    def _withdraw(self) -> None:
        """Remove every announced chunk, keeping its description: a snapshot that shows it
        again announces it again."""
        for k0, c in list(self.held.items()):
            del self.held[k0]
            self.pending[k0] = c
            self.removed += 1
            self._removed(c)

    def _unmap(self, c: Chunk) -> None:
        for k in c.keys[1:]:
            self.rank0.pop(k, None)

    def _stored(self, c: Chunk) -> None:
        hashes = [maybe_convert_block_hash(h) for h in c.hashes]
        parent = None if c.parent is None else maybe_convert_block_hash(c.parent)
        last = self._out[-1] if self._out else None
        if (last is not None and last["kind"] == "stored" and last["block_hashes"][-1] == parent
                and (last["lora_id"], last["lora_name"]) == (c.lora_id, c.lora_name)
                and (last["extra_keys"] is None) == (c.extra is None)):
            last["block_hashes"] += hashes   # the next chunk of the same chain: one event
            last["token_ids"] += c.tokens.tolist()
            if c.extra is not None:
                last["extra_keys"] += c.extra
            return
        self._out.append({"kind": "stored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": c.tokens.tolist(), "block_size": self.block_size,
                          "lora_id": c.lora_id, "lora_name": c.lora_name,
                          "extra_keys": None if c.extra is None else list(c.extra)})

    def _removed(self, c: Chunk) -> None:
        hashes = [maybe_convert_block_hash(h) for h in c.hashes]
        if self._out and self._out[-1]["kind"] == "removed":
            self._out[-1]["block_hashes"] += hashes
        else:
            self._out.append({"kind": "removed", "block_hashes": hashes})


def _held_in(c: Chunk, keys: dict[int, set[bytes]]) -> bool:
    return all(k in keys.get(r, ()) for r, k in enumerate(c.keys))


def _event(e: dict):
    """One event as the running vLLM's struct (fields it lacks are left out)."""
    if e["kind"] == "removed":
        kw = {"block_hashes": e["block_hashes"], "medium": MEDIUM, "group_idx": 0}
        return BlockRemoved(**{k: v for k, v in kw.items() if k in _REMOVED_FIELDS})
    kw = {k: v for k, v in e.items() if k != "kind"}
    kw.update(medium=MEDIUM, group_idx=0)
    return BlockStored(**{k: v for k, v in kw.items() if k in _STORED_FIELDS})


def for_engine(vllm_config, asked: bool, block_size: int) -> TierEvents | None:
    """The tier's events for this engine: only where asked (kv_connector_extra_config
    "kv_events") and vLLM publishes KV events (--kv-events-config), else None."""
    if not asked:
        return None
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False):
        logger.warning('kvedit connector: "kv_events" is on but this vLLM publishes no KV '
                       'events, so none are made; start vLLM with --kv-events-config '
                       '\'{"enable_kv_cache_events": true, "publisher": "zmq", ...}\' '
                       '(docs/connector.md, "KV events for routers")')
        return None
    return TierEvents(block_size)
