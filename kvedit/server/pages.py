"""Ready objects in commit order, for GET/DELETE /cache and Unregister.

Why: /cache pages through a million objects, so a page must cost O(page), not a scan of
the tables. Every ready object is kept here by its commit stamp (`Obj.seq`, the cursor a
client passes back), in one sorted set of all and one per model; a page is a walk after
the cursor. The index adds objects at commit and removes them when they are hidden
(deleted, evicted, expired); nothing else changes these sets.
"""
from __future__ import annotations

from kvedit.server.index_types import CacheEntry, Obj, Page
from kvedit.server.ordered import SortedInts
from kvedit.server.shards import IntMap


class CommitOrder:
    def __init__(self):
        self._all = SortedInts()                        # seqs of ready objects
        self._by_model: dict[str, SortedInts] = {}
        self._by_seq = IntMap()   # sharded: one big dict rebuilt in one go (shards.py)
        self._counts: dict[tuple[str, int], int] = {}   # ready objects of (model, tp_rank)

    def __len__(self) -> int:
        """Ready objects (of every model)."""
        return len(self._all)

    def add(self, objs: list[Obj]) -> None:
        """Objects of one store (one model and tp_rank) just committed, their seqs newest
        of all and ascending."""
        if not objs:
            return
        seqs = [o.seq for o in objs]
        self._by_seq.put(objs, seqs)
        self._all.update(seqs)
        self._by_model.setdefault(objs[0].model, SortedInts()).update(seqs)
        key = (objs[0].model, objs[0].tp_rank)   # one store: one (model, tp_rank)
        self._counts[key] = self._counts.get(key, 0) + len(objs)

    def remove(self, o: Obj) -> None:
        """A ready object hidden (deleted, evicted, expired)."""
        self._all.discard(o.seq)
        model_seqs = self._by_model[o.model]
        model_seqs.discard(o.seq)
        if not model_seqs:
            del self._by_model[o.model]
        del self._by_seq[o.seq]
        key = (o.model, o.tp_rank)
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]

    def count(self, model: str, tp_rank: int) -> int:
        """Ready objects of (model, tp_rank): O(1)."""
        return self._counts.get((model, tp_rank), 0)

    def ready(self, model: str | None = None) -> list[Obj]:
        """Every ready object (of `model`), oldest commit first. O(objects returned)."""
        seqs = self._seqs(model)
        return [self._by_seq[s] for s in seqs.after(None)] if seqs else []

    def newest(self, model: str | None = None) -> int | None:
        """The commit stamp of the newest ready object (of `model`); None if none."""
        seqs = self._seqs(model)
        return seqs.last() if seqs else None

    def after(self, model: str | None, cursor: int | None,
              limit: int) -> tuple[list[Obj], int | None]:
        """Up to `limit` ready objects of `model` committed after stamp `cursor` (None: from
        the oldest), and the stamp to go on from (None when there were none). O(limit): a
        key watch's snapshot is built from these slices (key_feed.py)."""
        seqs = self._seqs(model)
        out: list[Obj] = []
        if seqs:
            by_seq = self._by_seq
            for s in seqs.after(cursor):
                out.append(by_seq[s])
                if len(out) == limit:
                    break
        return out, (out[-1].seq if out else None)

    def page(self, model: str | None, after: int | None, limit: int) -> Page:
        """Up to `limit` ready objects (of `model`) in commit order after cursor `after`."""
        seqs = self._seqs(model)
        if seqs is None:
            return Page([], None, 0)
        items = []
        for s in seqs.after(after):
            if len(items) == limit:
                return Page(items, items[-1].seq, len(seqs))
            o = self._by_seq[s]
            items.append(CacheEntry(o.seq, o.model, o.tp_rank, o.key, o.nbytes, o.created,
                                    o.leases, o.kind))
        return Page(items, None, len(seqs))

    def _seqs(self, model: str | None) -> SortedInts | None:
        return self._all if model is None else self._by_model.get(model)
