"""Key watches: clients that keep their own copy of which "kv" keys of a model are ready.

Why: the connector's scheduler side asks the server, for every new request, how many of its
chunks it holds, in vLLM's scheduler loop; most answers are "none" (the request's new text),
and each cost a round trip while the whole engine waits (0.6-0.8 ms on an H200 host). With a
watch (kvedit.client.key_watch) it answers those misses from its own copy and asks the
server only when the copy says the first chunk is there.

How: `WatchKeys` subscribes a client socket (its ROUTER identity) to a model's tp_ranks. The
server sends a snapshot of the ready keys in parts, and pushes of the keys that become ready
(commit) or go (evicted, deleted, cleared), all numbered by one `seq` per subscription. The
index reports each change to `ready`/`gone`; the service calls `flush` before it sends any
reply and once per loop, so a push about a commit always leaves before the Committed reply
of the store that made it: a client that stored and then sends vLLM a request finds the key
in the watcher's copy. Parts and pushes interleave in seq order; a part holds each key's
state when it was scanned and every later change follows it, so the copy ends right.

Why it is bounded the way it is: a watch is the one place where a small request makes the
server send much (a snapshot of a million keys is ~18 MB), and bytes sent to a client that
does not read stay in the server (ZMQ's queue for that peer) until it reads or goes. So
(WatchLimits, from the server's --watch-* settings; docs/protocol.md, "Key watches"):
- what the server sent a watch's socket and the client has not acknowledged is at most
  `queued_bytes` per watch, `per_holder` for all watches of one session (a share of the
  total: two sessions' unread watches used to fill it and keep every other watch waiting)
  and `queued_total` in all; when only the total is short, the watch whose bytes have
  waited longest (over RECLAIM_AFTER_S) is cut first to make room. A renewal acknowledges the last seq the
  client applied, counted only as far as the kernel says bytes reached the client
  (peers.py), so a client cannot acknowledge what it did not read. A snapshot is sent while
  there is room and waits for acknowledgements when there is none; a push that does not fit
  drops the watch: the client is told (WatchAck seq -1) and subscribes again;
- snapshots are built in slices of PART_KEYS keys, at most `slice_s` of loop time per pass
  (one built in one go held the loop ~0.3 s at a million objects); a socket has one snapshot
  at a time (a new subscription replaces it), and a session subscribes at most
  `subscribes_per_min` times a minute (a burst of `subscribe_burst`);
- at most `max_watches` watches in all and `per_client` per session (too_many_waits); a watch
  not renewed within `ttl_s`, or whose bytes stay unacknowledged that long, ends, and when
  the server still holds bytes for it its connection is cut (peers.py), which frees them,
  as Redis disconnects a pub/sub client past its output buffer limit; all of a session's
  watches end when its last socket goes;
- a push is encoded once per group of watches that follow the same ranks of a model, in
  messages of at most PART_KEYS keys, so its cost does not grow with watches x changes.
Pending changes are at most one entry per watched key changed since the last flush.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvedit import protocol as P
from kvedit.server.index_types import Obj
from kvedit.server.waiters import TooManyWaits

PART_KEYS = 4096          # keys in one snapshot part or push message
# the most one part or push message can take, keys of MAX_KEY_BYTES included: what a watch
# must have room for before the server scans for one
PART_BYTES = PART_KEYS * (P.MAX_KEY_BYTES + 3) + 256
RECLAIM_AFTER_S = 2.0     # a watch acknowledges every second: one waiting this long is stuck


@dataclass(frozen=True, slots=True)
class WatchLimits:
    max_watches: int = 64
    per_client: int = 4
    ttl_s: float = 30.0
    queued_bytes: int = 4 << 20     # per watch: sent, not yet acknowledged
    queued_total: int = 32 << 20    # all watches together
    per_holder: int = 4 << 20       # all watches of one session together
    subscribes_per_min: float = 30.0
    subscribe_burst: int = 8
    slice_s: float = 0.004          # loop time a pass may spend building snapshots


MAX_WATCHES = WatchLimits().max_watches
MAX_PER_HOLDER = WatchLimits().per_client


@dataclass(slots=True, eq=False)
class Watch:
    ident: bytes                # ROUTER identity of the subscribed socket
    holder: bytes               # its client session
    rid: bytes = b""            # the subscription's request id (its messages carry it)
    model: str = ""
    ranks: frozenset[int] = frozenset()
    epoch: int = 0
    deadline: float = 0.0       # renewed by then, or it ends
    live: bool = False          # False: dropped (its bytes still count until acknowledged)
    seq: int = -1               # the subscription's last message
    building: bool = False      # its snapshot is not complete
    cursor: int | None = None   # the snapshot scanned ready objects up to this commit stamp
    # bytes: everything sent to this socket since the watch began (replies too: one queue)
    sent: int = 0
    acked: int = 0              # ... of which the client acknowledged reading
    ends: array = field(default_factory=lambda: array("q"))  # `sent` after seq base, base+1..
    base: int = 0
    since: float | None = None  # since when bytes have been waiting unacknowledged
    conn: tuple[int, int] | None = None   # (connection, bytes the kernel had delivered) at start

    @property
    def queued(self) -> int:
        return self.sent - self.acked


class KeyFeed:
    def __init__(self, limits: WatchLimits, send: Callable[[bytes, bytes, bytes], None],
                 ready_after: Callable[[str, int | None, int], tuple[list[Obj], int | None]],
                 delivered: Callable[[bytes], tuple[int, int] | None] = lambda ident: None,
                 cut: Callable[[bytes], None] = lambda ident: None,
                 clock: Callable[[], float] = time.monotonic):
        """`send(ident, rid, body)` sends (and, through `count`, reports) one message;
        `ready_after(model, cursor, n)` -> up to n ready objects of the model after the commit
        stamp `cursor`, and the stamp to go on from; `delivered(ident)` -> (connection, bytes
        the kernel delivered to the peer on it), None if unknown; `cut(ident)` closes the
        peer's connection."""
        self.lim, self.clock = limits, clock
        self._send, self._ready_after, self._delivered, self._cut = (
            send, ready_after, delivered, cut)
        self.watches: dict[bytes, Watch] = {}        # by ident
        self._by_model: dict[str, list[Watch]] = {}  # live watches of each model
        self._building: dict[bytes, Watch] = {}      # snapshots under way, in turn order
        # keys changed since the last flush: model -> {(tp_rank, key): ready now}
        self._changes: dict[str, dict[tuple[int, bytes], bool]] = {}
        self._tokens: dict[bytes, tuple[float, float]] = {}   # holder -> (tokens, when)
        self.total = 0          # bytes queued for all watches (sent, unacknowledged)
        self._held: dict[bytes, int] = {}   # ... for each session's watches
        self.reclaimed = 0      # watches cut to make room in the total for another
        self.pushes = 0
        self.parts = 0
        self.dropped = 0        # watches dropped past a byte bound
        self.cuts = 0           # connections cut (unacknowledged bytes past the TTL)

    def __len__(self) -> int:
        return len(self.watches)

    # ---- the index reports -------------------------------------------------------------
    def ready(self, objs: list[Obj]) -> None:
        if self._by_model:
            for o in objs:
                self._note(o, True)

    def gone(self, o: Obj) -> None:
        if self._by_model:
            self._note(o, False)

    def _note(self, o: Obj, ready: bool) -> None:
        if o.kind == "kv" and o.model in self._by_model:
            self._changes.setdefault(o.model, {})[(o.tp_rank, o.key)] = ready

    # ---- bytes -------------------------------------------------------------------------
    def count(self, ident: bytes, nbytes: int) -> bool:
        """The service sent `nbytes` to `ident` (every message to a watched socket counts:
        they share its queue) -> whether `ident` is a watch's socket (counted here)."""
        w = self.watches.get(ident)
        if w is None:
            return False
        w.sent += nbytes
        self._add(w, nbytes)
        if w.since is None:
            w.since = self.clock()
        return True

    def _add(self, w: Watch, nbytes: int) -> None:
        """`nbytes` more (or fewer) queued for `w`: in the total and its session's."""
        self.total += nbytes
        left = self._held.get(w.holder, 0) + nbytes
        if left:
            self._held[w.holder] = left
        else:
            self._held.pop(w.holder, None)

    def _fits(self, w: Watch, nbytes: int) -> bool:
        return (w.queued + nbytes <= self.lim.queued_bytes
                and self._held.get(w.holder, 0) + nbytes <= self.lim.per_holder
                and self.total + nbytes <= self.lim.queued_total)

    def _room(self, w: Watch, nbytes: int) -> bool:
        """`_fits`, after cutting the watches whose bytes have waited longest (over
        RECLAIM_AFTER_S) when only the total is short."""
        if self._fits(w, nbytes):
            return True
        if (w.queued + nbytes > self.lim.queued_bytes
                or self._held.get(w.holder, 0) + nbytes > self.lim.per_holder):
            return False
        now = self.clock()
        while self.total + nbytes > self.lim.queued_total:
            stuck = [x for x in self.watches.values() if x is not w and x.queued
                     and x.since is not None and now - x.since > RECLAIM_AFTER_S]
            if not stuck:
                return False
            victim = min(stuck, key=lambda x: x.since)
            self._end(victim)
            self.reclaimed += 1
            self._cut(victim.ident)   # frees what ZMQ still holds for it
        return True

    def _ack(self, w: Watch, seen: int) -> None:
        """The client says it applied message `seen` of the current subscription."""
        if not w.base <= seen <= w.seq:
            return
        claimed = w.ends[seen - w.base]
        del w.ends[:seen - w.base + 1]
        w.base = seen + 1
        now = self._delivered(w.ident)
        if now is not None and w.conn is not None:
            if now[0] != w.conn[0]:   # a new connection: the old one's queue went with it
                self._reset_bytes(w, now)
                return
            claimed = min(claimed, now[1] - w.conn[1])   # no more than the kernel delivered
        if claimed > w.acked:
            self._add(w, -(claimed - w.acked))
            w.acked = claimed
            w.since = self.clock() if w.queued else None

    def _reset_bytes(self, w: Watch, conn: tuple[int, int] | None) -> None:
        self._add(w, -w.queued)
        w.sent = w.acked = 0
        w.since = None
        w.ends = array("q")
        w.base = w.seq + 1
        w.conn = conn

    # ---- subscriptions -----------------------------------------------------------------
    def watch(self, ident: bytes, holder: bytes, rid: bytes, req: P.WatchKeys):
        """Handle WatchKeys -> a WatchAck for a renewal, None for a subscription (its
        snapshot's first part is sent here). TooManyWaits over the bounds."""
        now = self.clock()
        w = self.watches.get(ident)
        if req.renew:
            if w is None or w.epoch != req.epoch or w.model != req.model:
                return P.WatchAck(epoch=req.epoch, seq=-1)
            self._ack(w, req.seen)
            if not w.live:
                return P.WatchAck(epoch=w.epoch, seq=-1)
            w.deadline = now + self.lim.ttl_s
            return P.WatchAck(epoch=w.epoch, seq=w.seq)
        self._spend(holder, now)
        if w is None:
            if len(self.watches) >= self.lim.max_watches:
                raise TooManyWaits(f"the server follows {self.lim.max_watches} key watches "
                                   f"already (--max-watches); this client asks the server "
                                   f"instead")
            mine = sum(1 for x in self.watches.values() if x.holder == holder)
            if mine >= self.lim.per_client:
                raise TooManyWaits(f"this client session has {mine} key watches, at most "
                                   f"{self.lim.per_client} (--max-watches-per-client)")
            w = self.watches[ident] = Watch(ident, holder, conn=self._delivered(ident))
        else:   # the socket subscribes again: what it read of the last one is acknowledged
            if req.epoch != w.epoch:
                self._ack(w, req.seen)
            self._unfollow(w)
        w.rid, w.model, w.ranks, w.epoch = rid, req.model, frozenset(req.tp_ranks), req.epoch
        w.live, w.building, w.cursor, w.seq = True, True, None, -1
        w.ends, w.base = array("q"), 0
        w.deadline = now + self.lim.ttl_s
        self._by_model.setdefault(w.model, []).append(w)
        self._building[ident] = w
        if self._room(w, PART_BYTES):
            self._part(w)   # the first part at once: the client knows it is answered
        return None

    def _spend(self, holder: bytes, now: float) -> None:
        """A subscription of `holder` costs a token (TooManyWaits when it has none)."""
        rate = self.lim.subscribes_per_min / 60.0
        burst = float(self.lim.subscribe_burst)
        tokens, when = self._tokens.get(holder, (burst, now))
        tokens = min(burst, tokens + (now - when) * rate)
        if tokens < 1.0:
            raise TooManyWaits(f"this client session subscribed to key watches more than "
                               f"{self.lim.subscribes_per_min:g} times a minute "
                               f"(--watch-subscribes-per-min); subscribe again in "
                               f"{(1.0 - tokens) / rate:.1f} s")
        if len(self._tokens) >= 4 * self.lim.max_watches and holder not in self._tokens:
            full = [h for h, (t, at) in self._tokens.items()
                    if min(burst, t + (now - at) * rate) >= burst]
            for h in full:   # a full bucket is what a new entry starts with: forget it
                del self._tokens[h]
        self._tokens[holder] = (tokens - 1.0, now)

    def drop_holder(self, holder: bytes) -> None:
        """The session's last socket went: its watches end (their queues went with them)."""
        for w in [w for w in self.watches.values() if w.holder == holder]:
            self._end(w)
        self._tokens.pop(holder, None)

    def disconnected(self, ident: bytes) -> None:
        """One socket's connection closed: its queue is gone, and so is its watch."""
        w = self.watches.get(ident)
        if w is not None:
            self._end(w)

    def expire(self, now: float) -> None:
        """End watches not renewed within the TTL, and those whose bytes stayed
        unacknowledged that long; cut the connection of those that still have bytes queued."""
        ttl = self.lim.ttl_s
        for w in list(self.watches.values()):
            stuck = w.since is not None and now - w.since > ttl
            if w.deadline <= now or stuck:
                cut = w.queued > 0
                self._end(w)
                if cut:
                    self.cuts += 1
                    self._cut(w.ident)

    def _unfollow(self, w: Watch) -> None:
        ws = self._by_model.get(w.model)
        if ws is not None and w in ws:
            ws.remove(w)
            if not ws:
                del self._by_model[w.model]
                self._changes.pop(w.model, None)
        self._building.pop(w.ident, None)
        w.live = w.building = False

    def _end(self, w: Watch) -> None:
        self._unfollow(w)
        self._add(w, -w.queued)
        del self.watches[w.ident]

    def _drop(self, w: Watch) -> None:
        """Past a byte bound: no more pushes; the client is told to subscribe again."""
        self._unfollow(w)
        self.dropped += 1
        self._send(w.ident, w.rid, P.encoder.encode(P.WatchAck(epoch=w.epoch, seq=-1)))

    # ---- snapshots ---------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether a snapshot is under way with room to send its next part."""
        return any(self._fits(w, PART_BYTES) for w in self._building.values())

    def work(self) -> None:
        """Build and send snapshot parts, taking turns, for at most `slice_s`."""
        end = self.clock() + self.lim.slice_s
        for ident in list(self._building):
            w = self._building.pop(ident, None)   # to the back of the turn order
            if w is None:   # cut meanwhile to make room for another
                continue
            self._building[ident] = w
            while w.building and self._room(w, PART_BYTES):
                self._part(w)
                if self.clock() >= end:
                    return

    def _part(self, w: Watch) -> None:
        objs, cursor = self._ready_after(w.model, w.cursor, PART_KEYS)
        keys: dict[int, list[bytes]] = {r: [] for r in w.ranks}
        for o in objs:
            if o.kind == "kv" and o.tp_rank in keys:
                keys[o.tp_rank].append(o.key)
        more = cursor is not None and len(objs) == PART_KEYS
        self._emit(w, P.KeySnapshot(epoch=w.epoch, keys=keys, seq=w.seq + 1, more=more))
        self.parts += 1
        w.cursor = cursor if cursor is not None else w.cursor
        if not more:
            w.building = False
            self._building.pop(w.ident, None)

    def _emit(self, w: Watch, msg) -> None:
        self._send(w.ident, w.rid, P.encoder.encode(msg))
        w.seq += 1
        w.ends.append(w.sent)

    # ---- pushes ------------------------------------------------------------------------
    def flush(self) -> None:
        """Push every change noted since the last flush to the watches that follow it."""
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        for model, ch in changes.items():
            groups: dict[frozenset[int], list[Watch]] = {}
            for w in self._by_model.get(model, ()):
                groups.setdefault(w.ranks, []).append(w)
            for ranks, ws in groups.items():
                for added, removed in _messages(ch, ranks):
                    for w in ws:
                        if not w.live:
                            continue
                        size = len(added) + len(removed) + 64   # + the header
                        if not self._room(w, size):
                            self._drop(w)
                            continue
                        self._emit(w, P.KeyEvents(epoch=w.epoch, seq=w.seq + 1,
                                                  added=added or {}, removed=removed or {}))
                        self.pushes += 1

    def snapshot(self) -> dict:
        return {"key_watches": len(self.watches), "key_pushes": self.pushes,
                "key_snapshot_parts": self.parts, "key_watch_queued_bytes": self.total,
                "key_watch_drops": self.dropped, "key_watch_cuts": self.cuts,
                "key_watch_reclaimed": self.reclaimed,
                "key_snapshots_building": len(self._building)}


def _messages(ch: dict[tuple[int, bytes], bool], ranks: frozenset[int]):
    """The changes of `ranks` as (added, removed) pairs of encoded maps ({rank: [keys]}; b""
    when empty), at most PART_KEYS keys a pair: each encoded once for every watch."""
    added: dict[int, list[bytes]] = {}
    removed: dict[int, list[bytes]] = {}
    n = 0
    for (rank, key), ready in ch.items():
        if rank in ranks:
            (added if ready else removed).setdefault(rank, []).append(key)
            n += 1
            if n == PART_KEYS:
                yield _raw(added), _raw(removed)
                added, removed, n = {}, {}, 0
    if n:
        yield _raw(added), _raw(removed)


def _raw(m: dict[int, list[bytes]]):
    """An encoded map spliced into every watch's message as is (b"" for none)."""
    return msgspec.Raw(P.encoder.encode(m)) if m else b""
