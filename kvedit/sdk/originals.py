"""Originals: the chunks a compressed stream came from, kept in the kvedit server for repair,
under a byte budget.

Why a module of its own: a compressed stream can be repaired for a new question only while
the chunks it was compressed from are in the server (kvedit.sdk.repair), and those chunks
cost host memory that nothing else would bound. The ledger owns one rule: while it holds an
original it references its chunks exactly once in the context (so no stream's modify or
release deletes them), and the bytes it holds stay under `max_bytes` (the least recently
used original is let go first: its chunks deleted unless a stream still uses them, its
tokens kept so a repair can recompute it). The chunks stay ordinary chunks in the server:
its own eviction may drop them like any other, and a repair finds that out by a lookup.

Who records what: `BatchedStream.modify(fn, originals=ledger)` snapshots each stream's
region before the edit (`snapshot`) and records the edited stream against it (`admit`), or
lets the snapshot go if the edit failed (`abandon`); `share` gives a stream built on a
compressed stream's cache (another question of the same context) the same original; repair
reads a stream's `record` and moves it to the repaired region (`moved`). `report()` says
what is held and what was let go, evicted or recomputed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvedit.sdk.stream import Stream


@dataclass(eq=False)
class Original:
    """A compressed stream's original region: whole chunks, under the salt it had then."""
    ctx: Any
    tokens: list[int]
    salt: str
    keys: list[bytes]            # rank 0's (the context deletes every rank's with them)
    nbytes: int                  # host memory its chunks take, every rank
    held: bool = True            # False: let go (budget); a repair must recompute it


@dataclass(eq=False)
class Record:
    """One stream against its original: the region it holds now instead (compressed, or
    repaired for its last question). What follows that region in the stream is the turn
    a repair scores with."""
    original: Original
    current: list[int] = field(default_factory=list)


class Originals:
    """The ledger of originals kept for repair (module docstring). `max_bytes`: host memory
    their chunks may take in the server, every rank counted."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"Originals(max_bytes={max_bytes!r}): expected a number of bytes "
                             f">= 0 (the host memory kept originals may take)")
        self.max_bytes = max_bytes
        self._records: dict[Stream, Record] = {}
        self._lru: OrderedDict[int, Original] = OrderedDict()   # held ones, least recent first
        self.counts = {"kept": 0, "let_go": 0, "evicted_seen": 0, "recomputed_tokens": 0,
                       "repairs": 0, "skipped": 0}

    @property
    def held_bytes(self) -> int:
        return sum(o.nbytes for o in self._lru.values())

    def snapshot(self, stream: Stream) -> Original | None:
        """The region a modify of `stream` is about to edit, its chunks referenced (None: no
        full chunk to keep)."""
        ctx, c = stream.ctx, stream.ctx.chunk_size
        n = stream.kv_tokens // c
        if n == 0:
            return None
        keys = list(stream.keys[:n])
        ctx.ref(keys)
        size = n * sum(layout.chunk_bytes for layout in ctx.layouts)
        return Original(ctx, list(stream.prompt[:n * c]), stream.cache_salt, keys, size)

    async def admit(self, stream: Stream, original: Original, after: int) -> None:
        """`stream` was edited from `original`; `after` tokens of its sequence follow the
        edited region (they followed the original region too). Lets older originals go
        past the budget."""
        self._forget(stream)
        self._records[stream] = Record(original, list(stream.prompt[:len(stream.prompt) - after]))
        self._lru[id(original)] = original
        self.counts["kept"] += 1
        await self.fit()

    async def abandon(self, original: Original | None) -> None:
        """A snapshot whose edit failed: its references go (the stream still holds its own)."""
        if original is not None:
            await _unref(original.ctx, original.keys)

    def share(self, src: Stream, dst: Stream) -> None:
        """`dst` holds src's compressed region (another question of the same cache): it is
        repaired from the same original."""
        rec = self.record(src)
        if rec is None:
            raise ValueError(f"{src.label} has no original kept: modify it with "
                             f"originals=this ledger first")
        if dst.prompt[:len(rec.current)] != rec.current:
            raise ValueError(f"{dst.label} does not start with {src.label}'s edited region "
                             f"({len(rec.current)} tokens): it cannot share its original")
        self._records[dst] = Record(rec.original, list(rec.current))

    def record(self, stream: Stream) -> Record | None:
        self._sweep()
        return self._records.get(stream)

    def moved(self, stream: Stream, current: list[int]) -> None:
        """`stream` now holds `current` in place of its original (repaired); most recent use."""
        rec = self._records[stream]
        rec.current = list(current)
        if id(rec.original) in self._lru:
            self._lru.move_to_end(id(rec.original))

    def readmit(self, original: Original) -> None:
        """A let-go original about to be recomputed (and stored) by a repair: held again."""
        if not original.held:
            original.ctx.ref(original.keys)
            original.held = True
            self._lru[id(original)] = original

    async def fit(self) -> None:
        """Let go the least recently used originals while the held bytes pass the budget."""
        while self._lru and self.held_bytes > self.max_bytes:
            _, original = self._lru.popitem(last=False)
            original.held = False
            self.counts["let_go"] += 1
            await _unref(original.ctx, original.keys)

    def report(self) -> dict:
        """What the ledger holds and what happened to originals so far."""
        self._sweep()
        return {"max_bytes": self.max_bytes, "held_bytes": self.held_bytes,
                "held_originals": len(self._lru), "streams": len(self._records),
                **self.counts}

    async def arelease(self) -> None:
        """Let every original go (their chunks deleted where no stream uses them)."""
        self._records.clear()
        while self._lru:
            _, original = self._lru.popitem(last=False)
            original.held = False
            await _unref(original.ctx, original.keys)

    def _forget(self, stream: Stream) -> None:
        self._records.pop(stream, None)

    def _sweep(self) -> None:
        """Records of released streams go (their originals stay until let go)."""
        for s in [s for s in self._records if s.released]:
            del self._records[s]


async def _unref(ctx, keys: list[bytes]) -> None:
    dead = ctx.unref(keys)
    if dead:
        await ctx.call(ctx.delete_kv, dead)
