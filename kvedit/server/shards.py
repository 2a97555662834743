"""Maps of a million entries cut into shards, so that no one insert rebuilds them all.

Why: a CPython dict grows (and, under churn, rebuilds itself) in one step when its entry
array is used up: the insert that finds it full re-hashes every entry. Deleted entries are
not reused, so an index that stays at a million objects while stores evict as many as they
add still rebuilds its tables every few million inserts. At 1.4 million objects one such
insert took 120-130 ms (this box, Python 3.11), and the index has three of these tables
(objects by key, the eviction order's and the commit order's objects by stamp): the commit
or prepare-store that happened to meet one held the control loop that long (a Hello waited
114 ms beside evicting stores in `kvedit bench soak`). A shard rebuilds only its own
entries, a few thousand.
- `KeyTable` (objects by (model, tp_rank, key)): shard by the key's hash (cached in the
  bytes object). Shards fill at the same pace, so their rebuilds come close together but
  not at once: they spread over tens of thousands of inserts;
- `IntMap` (objects by commit stamp or eviction rank, numbers one clock hands out in
  order): shard by runs of 2^RUN_BITS consecutive numbers, so one store's objects
  (consecutive stamps) land in one or two shards and a shard empties as its stamps age out.
Only what the index needs of a dict: get, [], del, in, len (O(shards)), keys and values.
"""
from __future__ import annotations

from collections.abc import Iterator

SHARDS = 256     # rebuilds cost 1/SHARDS of one table's; 256 empty dicts weigh ~15 KiB
MASK = SHARDS - 1
RUN_BITS = 13    # 2^13 consecutive stamps share an IntMap shard (one store of 8,192 keys)


class KeyTable:
    """A dict keyed by (model, tp_rank, key, ...) tuples, sharded by hash(key)."""
    __slots__ = ("_shards",)

    def __init__(self):
        self._shards: list[dict] = [{} for _ in range(SHARDS)]

    def find(self, model: str, tp_rank: int, keys) -> list:
        """The entry (None: none) of (model, tp_rank, k) for each k of `keys`, in one loop."""
        s = self._shards
        return [s[hash(k) & MASK].get((model, tp_rank, k)) for k in keys]

    def first(self, model: str, tp_rank: int, keys):
        """-> a function of one key giving its entry or None: for loops that stop early."""
        s = self._shards
        return lambda k: s[hash(k) & MASK].get((model, tp_rank, k))

    def put(self, objs) -> None:
        """Enter each object of `objs` under its `ident` (its `key` is ident[2])."""
        s = self._shards
        for o in objs:
            s[hash(o.key) & MASK][o.ident] = o

    def get(self, ident: tuple, default=None):
        return self._shards[hash(ident[2]) & MASK].get(ident, default)

    def __getitem__(self, ident: tuple):
        return self._shards[hash(ident[2]) & MASK][ident]

    def __setitem__(self, ident: tuple, value) -> None:
        self._shards[hash(ident[2]) & MASK][ident] = value

    def __delitem__(self, ident: tuple) -> None:
        del self._shards[hash(ident[2]) & MASK][ident]

    def __contains__(self, ident: tuple) -> bool:
        return ident in self._shards[hash(ident[2]) & MASK]

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def __iter__(self) -> Iterator:
        for s in self._shards:
            yield from s

    def keys(self) -> Iterator:
        return iter(self)

    def values(self) -> Iterator:
        for s in self._shards:
            yield from s.values()


class IntMap:
    """A dict keyed by ints handed out in order, sharded by runs of 2^RUN_BITS of them."""
    __slots__ = ("_shards",)

    def __init__(self):
        self._shards: list[dict] = [{} for _ in range(SHARDS)]

    def get(self, k: int, default=None):
        return self._shards[(k >> RUN_BITS) & MASK].get(k, default)

    def put(self, objs, ks=None) -> None:
        """Enter each object of `objs` under its `rank` (or under `ks`, one each)."""
        s = self._shards
        for o, k in zip(objs, ks if ks is not None else [o.rank for o in objs]):
            s[(k >> RUN_BITS) & MASK][k] = o

    def __getitem__(self, k: int):
        return self._shards[(k >> RUN_BITS) & MASK][k]

    def __setitem__(self, k: int, value) -> None:
        self._shards[(k >> RUN_BITS) & MASK][k] = value

    def __delitem__(self, k: int) -> None:
        del self._shards[(k >> RUN_BITS) & MASK][k]

    def __contains__(self, k: int) -> bool:
        return k in self._shards[(k >> RUN_BITS) & MASK]

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def __iter__(self) -> Iterator[int]:
        for s in self._shards:
            yield from s

    def keys(self) -> Iterator[int]:
        return iter(self)

    def values(self) -> Iterator:
        for s in self._shards:
            yield from s.values()
