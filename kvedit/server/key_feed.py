"""Key watches: clients that keep their own copy of which "kv" keys of a model are ready.

Why: the connector's scheduler side asks the server, for every new request, how many of its
chunks it holds, in vLLM's scheduler loop; most answers are "none" (the request's new text),
and each cost a round trip while the whole engine waits (0.6-0.8 ms on an H200 host). With a
watch (kvedit.client.key_watch) it answers those misses from its own copy and asks the
server only when the copy says the first chunk is there.

How: `WatchKeys` subscribes a client socket (its ROUTER identity) to a model's tp_ranks; the
reply is a snapshot of the ready keys. The index reports every key that becomes ready
(commit) or goes (evicted, deleted, cleared) to `ready`/`gone`; the service calls `flush`
before it sends any reply and once per loop, so a push about a commit always leaves before
the Committed reply of the store that made it: a client that stored and then sends vLLM a
request finds the key in the watcher's copy. Pushes are numbered per subscription (a gap:
a push dropped on a full queue, the client subscribes again).

Bounded: at most MAX_WATCHES watches in all and MAX_PER_HOLDER per client session (a further
subscription is refused `too_many_waits`); a watch not renewed within WATCH_TTL_S ends, and
all of a session's watches end when its last socket goes. Pending changes are at most one
entry per watched key changed since the last flush (a flush runs at least once per loop).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvedit import protocol as P
from kvedit.server.index_types import Obj
from kvedit.server.waiters import TooManyWaits

MAX_WATCHES = 64
MAX_PER_HOLDER = 4
WATCH_TTL_S = 30.0


@dataclass(slots=True, eq=False)
class Watch:
    ident: bytes           # ROUTER identity of the subscribed socket
    holder: bytes          # its client session
    rid: bytes             # the subscription's request id (pushes carry it)
    model: str
    ranks: frozenset[int]
    epoch: int
    deadline: float
    seq: int = 0           # pushes sent in this subscription


class KeyFeed:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.watches: dict[bytes, Watch] = {}        # by ident
        self._models: dict[str, int] = {}            # watched model -> watches
        # keys changed since the last flush: model -> {(tp_rank, key): ready now}
        self._changes: dict[str, dict[tuple[int, bytes], bool]] = {}
        self.pushes = 0

    def __len__(self) -> int:
        return len(self.watches)

    # ---- the index reports -------------------------------------------------------------
    def ready(self, objs: list[Obj]) -> None:
        if self._models:
            for o in objs:
                self._note(o, True)

    def gone(self, o: Obj) -> None:
        if self._models:
            self._note(o, False)

    def _note(self, o: Obj, ready: bool) -> None:
        if o.kind == "kv" and o.model in self._models:
            self._changes.setdefault(o.model, {})[(o.tp_rank, o.key)] = ready

    # ---- subscriptions -----------------------------------------------------------------
    def watch(self, ident: bytes, holder: bytes, rid: bytes, req: P.WatchKeys,
              ready_objs: Callable[[str], list[Obj]]):
        """Handle WatchKeys -> the reply (KeySnapshot or WatchAck). TooManyWaits over the
        bounds."""
        w = self.watches.get(ident)
        if req.renew:
            if w is None or w.epoch != req.epoch or w.model != req.model:
                return P.WatchAck(epoch=req.epoch, seq=-1)
            w.deadline = self.clock() + WATCH_TTL_S
            return P.WatchAck(epoch=w.epoch, seq=w.seq)
        if w is None:
            if len(self.watches) >= MAX_WATCHES:
                raise TooManyWaits(f"the server follows {MAX_WATCHES} key watches already "
                                   f"(its limit); this client asks the server instead")
            mine = sum(1 for x in self.watches.values() if x.holder == holder)
            if mine >= MAX_PER_HOLDER:
                raise TooManyWaits(f"this client session has {mine} key watches, at most "
                                   f"{MAX_PER_HOLDER}")
        else:
            self._drop(w)
        ranks = frozenset(req.tp_ranks)
        w = Watch(ident, holder, rid, req.model, ranks, req.epoch, self.clock() + WATCH_TTL_S)
        self.watches[ident] = w
        self._models[w.model] = self._models.get(w.model, 0) + 1
        # the service flushed every change noted before this request: the snapshot is the
        # state the first push (seq 1) starts from
        keys: dict[int, list[bytes]] = {r: [] for r in ranks}
        for o in ready_objs(w.model):
            if o.tp_rank in ranks and o.kind == "kv":
                keys[o.tp_rank].append(o.key)
        return P.KeySnapshot(epoch=w.epoch, keys=keys)

    def drop_holder(self, holder: bytes) -> None:
        for w in [w for w in self.watches.values() if w.holder == holder]:
            self._drop(w)

    def expire(self, now: float) -> None:
        for w in [w for w in self.watches.values() if w.deadline <= now]:
            self._drop(w)

    def _drop(self, w: Watch) -> None:
        del self.watches[w.ident]
        n = self._models[w.model] - 1
        if n:
            self._models[w.model] = n
        else:
            del self._models[w.model]
            self._changes.pop(w.model, None)

    # ---- pushes ------------------------------------------------------------------------
    def flush(self, send: Callable[[bytes, bytes, object], None]) -> None:
        """Push every change noted since the last flush to the watches that follow it."""
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        for w in self.watches.values():
            ch = changes.get(w.model)
            if ch is None:
                continue
            added: dict[int, list[bytes]] = {}
            removed: dict[int, list[bytes]] = {}
            for (rank, key), ready in ch.items():
                if rank in w.ranks:
                    (added if ready else removed).setdefault(rank, []).append(key)
            if added or removed:
                w.seq += 1
                self.pushes += 1
                send(w.ident, w.rid, P.KeyEvents(epoch=w.epoch, seq=w.seq, added=added,
                                                 removed=removed))
