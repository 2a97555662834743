"""The second tier: chunks written behind to Redis, lookups that miss L1 served from it.

Two threads, each with its own Redis connection, so the ZMQ loop never waits on Redis:
- the writer drains the write-behind queue: a committed chunk is SET from its L1 slot (no
  copy). The queue holds references, bounded in bytes (--l2-write-queue-mb): beyond the bound
  the oldest entries are dropped and counted. Nothing pins the slot: the writer checks the
  object is still live after sending (objects are immutable once ready, so a live object's
  slot was not touched meanwhile); one evicted or deleted during the send is DELeted from
  Redis again (its bytes may be torn) and counted as skipped.
- the reader answers probes: a lookup whose leading keys miss L1 is parked by the service and
  handed here; the reader MGETs their metas, and for each leading hit allocates an L1 slot
  (a WRITING store of the service's own), reads the payload straight into it, checks the
  checksum and commits (publish). The commit wakes parked lookups through the service's waiter
  mechanism; when the probe ends the service answers the lookup that asked for it.

Degrades, never breaks: a Redis error marks the tier down (logged once per outage with the
node that failed, counted); while down no probe is made (lookups answer from L1 at once) and
writes stay queued (still bounded); the writer pings with backoff and, once Redis answers (for
a cluster: once every slot has a master that answers, e.g. a replica promoted in place of a
dead master), catches up on the queue. The nodes that failed during an outage, and since when,
are in the snapshot (/status, /metrics) until it ends.
Thread hand-off: the threads call the service's narrow l2_* methods (each takes its lock) and
post events (`Promoted`, `ProbeDone`) that the loop drains when the wake socket is readable:
only the loop thread sends on the ROUTER socket.
"""
from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import msgspec

from kvedit.layout import ModelLayout
from kvedit.server.l2_url import parse, redacted

try:   # the `l2` extra: only a server started with --l2-url needs it
    import redis

    from kvedit.server.l2_nodes import open_nodes
    from kvedit.server.l2_redis import ERRORS, RedisChunks, layout_tag, redis_key
except ImportError as e:
    redis = None
    _MISSING_EXTRA = e

log = logging.getLogger("kvedit.server")
BACKOFF_MIN = 0.2                     # first wait between pings while Redis is unreachable;
                                      # doubling up to the nodes' retry_max_s (l2_nodes.py)
MAX_PROBES = 256                      # probes queued for the reader; beyond, L1 answers alone
PROMOTE_FOR = 60.0                    # seconds a probe keeps promoting, even after its lookup
                                      # was answered (the next lookup then hits L1)


# ---- what the tier needs from the service ----------------------------------------------
@dataclass(frozen=True, slots=True)
class Fill:
    store_id: int
    view: Any                 # writable buffer over the new slot


FillRefusal = Literal["present", "full"]


class L2Host(Protocol):
    """The service's narrow methods for the L2 threads; each takes the service lock."""

    def l2_is_live(self, obj) -> bool: ...
    def l2_view(self, obj): ...
    def l2_begin_fill(self, model: str, tp_rank: int, key: bytes,
                      nbytes: int) -> Fill | FillRefusal: ...
    def l2_end_fill(self, store_id: int, ok: bool) -> list: ...


# ---- jobs and events ---------------------------------------------------------------------
@dataclass(slots=True)
class _Write:
    obj: Any                  # the index's Obj (live check, slot)
    rkey: bytes
    nbytes: int
    data: Any = None          # owned bytes (write-on-evict); None: read the slot


@dataclass(slots=True)
class Probe:
    model: str
    tp_rank: int
    layout: ModelLayout
    keys: list[bytes]         # the leading keys that missed L1, in order
    deadline: float           # monotonic: stop promoting past it (a stale probe)
    waiter: Any = None        # the parked lookup to answer when done


@dataclass(frozen=True, slots=True)
class Promoted:
    idents: list              # (model, tp_rank, key) now ready in L1: wake their waiters


@dataclass(frozen=True, slots=True)
class ProbeDone:
    waiter: Any


@dataclass(slots=True)
class L2Counters:
    """What /status and /metrics show about the tier (one owner: this module)."""
    probes: int = 0           # lookups that fell through to L2 (one MGET each)
    hits: int = 0             # chunks found in L2 and promoted into L1 (= promotions)
    misses: int = 0           # probes that stopped at a key L2 does not hold
    promoted_bytes: int = 0
    corrupt: int = 0          # records whose length or checksum did not match: treated as misses
    writes: int = 0           # chunks written to L2
    write_bytes: int = 0
    write_seconds: float = 0.0   # the writer's time in writes (checks, hash, MULTI/EXEC)
    write_dropped: int = 0    # dropped from the full write-behind queue (oldest first)
    write_skipped: int = 0    # evicted/deleted before (or while) being written
    errors: int = 0           # Redis operations that failed (down, timeout, protocol)
    outages: int = 0          # times the tier went down


class L2Tier:
    def __init__(self, host: L2Host, url: str, *, prefix: str, ttl: float, timeout: float,
                 max_queue_bytes: int, write_on: str = "commit",
                 mac_key: bytes | None = None):
        if redis is None:
            raise RuntimeError(f"--l2-url needs the `l2` extra (redis, xxhash), which is not "
                               f"installed ({_MISSING_EXTRA}): pip install 'kvedit[l2]'")
        self.host, self.url, self.prefix, self.write_on = host, url, prefix, write_on
        self.max_queue_bytes = max_queue_bytes
        self.counters = L2Counters()
        self.up = True            # optimistic: the first failure logs the outage
        self._down_since = 0.0
        self._down_nodes: dict[str, float] = {}   # node -> wall time it first failed (outage)
        self._lock = threading.Lock()   # counters, queue, health (never held over I/O)
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[_Write] = collections.deque()
        self._queued_bytes = 0
        self._queued: dict[int, _Write] = {}   # id(obj) -> its queued write (slot reads)
        self._writing = 0                        # 1 while the writer sends one
        self._probes: queue.SimpleQueue[Probe | None] = queue.SimpleQueue()
        self._probes_queued = 0
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._tags: dict[bytes, str] = {}   # encoded layout -> tag (layouts hold dicts: no hash)
        self._stop = False
        self._logged: set[str] = set()           # kinds of Redis refusals already logged
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # one routing (a cluster's slot map) for both threads; each checks out its own
        # connection per operation
        self._nodes = open_nodes(parse(url), timeout)
        self._writer_redis = RedisChunks(url, timeout, ttl, mac_key, nodes=self._nodes)
        self._reader_redis = RedisChunks(url, timeout, ttl, mac_key, nodes=self._nodes)
        self._threads = [threading.Thread(target=self._write_loop, name="kvedit-l2-writer",
                                          daemon=True),
                         threading.Thread(target=self._read_loop, name="kvedit-l2-reader",
                                          daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._probes.put(None)
        for t in self._threads:
            t.join(2)   # daemon threads: a hung Redis must not hold up shutdown
        self._nodes.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- loop side (called by the service on its thread) --------------------------------
    @property
    def wake_fd(self) -> int:
        return self._wake_r.fileno()

    def events(self) -> list:
        """Drain the events the threads posted (the loop calls this when wake_fd is readable)."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def rkeys(self, model: str, tp_rank: int, layout: ModelLayout,
              keys: list[bytes]) -> list[bytes]:
        """The Redis keys of chunk keys of one model/rank/layout (the tag is looked up once)."""
        enc = msgspec.msgpack.encode(layout)
        tag = self._tags.get(enc)
        if tag is None:
            if len(self._tags) > 4096:   # layouts come and go with registrations: stay bounded
                self._tags.clear()
            tag = self._tags[enc] = layout_tag(layout)
        return [redis_key(self.prefix, model, tag, tp_rank, k) for k in keys]

    def write_behind(self, objs: list, layout: ModelLayout) -> None:
        """Queue committed objects for writing (O(1) each; never blocks on Redis)."""
        if self.write_on != "commit" or not objs:
            return
        o = objs[0]   # one store: one model and rank
        rkeys = self.rkeys(o.model, o.tp_rank, layout, [x.key for x in objs])
        with self._cv:
            for o, rk in zip(objs, rkeys):
                self._enqueue(_Write(o, rk, o.nbytes))
            self._cv.notify()

    def evicting(self, obj, layout: ModelLayout, view) -> None:
        """L1 evicts `obj` now (on the loop thread; its slot is reused right after). A write
        still queued for it takes a copy of its bytes, so the eviction does not lose it from
        both tiers; with write_on "evict" this is when it is queued at all."""
        with self._cv:
            w = self._queued.get(id(obj))
            if w is not None:
                if w.data is None:
                    w.data = bytes(view)
                return
            if self.write_on == "evict":
                rk = self.rkeys(obj.model, obj.tp_rank, layout, [obj.key])[0]
                self._enqueue(_Write(obj, rk, obj.nbytes, bytes(view)))
                self._cv.notify()

    @property
    def queue_bytes(self) -> int:
        """Bytes of the writes waiting (a plain read: the loop's memory estimate, trim.py)."""
        return self._queued_bytes

    def can_probe(self) -> bool:
        """Whether a lookup that misses L1 should wait for L2 (up, reader not swamped)."""
        return self.up and self._probes_queued < MAX_PROBES

    def probe(self, p: Probe) -> None:
        with self._lock:
            self._probes_queued += 1
        self._probes.put(p)

    def snapshot(self) -> dict:
        with self._lock:
            d = {f"l2_{k}": v for k, v in asdict(self.counters).items()}
            d |= {"l2_up": int(self.up), "l2_queue_depth": len(self._queue),
                  "l2_queue_bytes": self._queued_bytes, "l2_probes_queued": self._probes_queued,
                  "l2_writing": self._writing,
                  # node -> wall time it failed, during an outage (/status, /metrics)
                  "l2_down_nodes": dict(self._down_nodes)}
        return d

    # ---- write-behind -------------------------------------------------------------------
    def _enqueue(self, w: _Write) -> None:
        if w.nbytes > self.max_queue_bytes:
            self.counters.write_dropped += 1
            return
        while self._queued_bytes + w.nbytes > self.max_queue_bytes:
            self._take(self._queue.popleft())
            self.counters.write_dropped += 1
        self._queue.append(w)
        self._queued_bytes += w.nbytes
        self._queued[id(w.obj)] = w

    def _take(self, w: _Write) -> _Write:
        """Account for `w` leaving the queue (caller holds the lock)."""
        self._queued_bytes -= w.nbytes
        if self._queued.get(id(w.obj)) is w:
            del self._queued[id(w.obj)]
        return w

    def _next_write(self) -> _Write | None:
        with self._cv:
            while not self._stop:
                if not self.up:
                    return None            # the caller pings (with backoff) first
                if self._queue:
                    self._writing = 1
                    return self._take(self._queue.popleft())
                self._cv.wait()
        return None

    def _write_loop(self) -> None:
        backoff = BACKOFF_MIN
        while not self._stop:
            if not self.up:
                with self._cv:
                    self._cv.wait(backoff)
                if self._stop:
                    return
                try:
                    self._writer_redis.ping(self._last_failed())
                except ERRORS as e:
                    self._node_failed(e)
                    backoff = min(self._nodes.retry_max_s, backoff * 2)
                    continue
                backoff = BACKOFF_MIN
                self._went_up()
                continue
            w = self._next_write()
            if w is None:
                continue
            try:
                self._write(w)
                with self._lock:
                    self._writing = 0
            except ERRORS as e:
                with self._cv:            # back at the front: it is the oldest
                    self._writing = 0
                    self._queue.appendleft(w)
                    self._queued_bytes += w.nbytes
                    self._queued[id(w.obj)] = w
                    while self._queued_bytes > self.max_queue_bytes:
                        self._take(self._queue.popleft())   # still bounded: oldest first
                        self.counters.write_dropped += 1
                self._went_down(e)
            except redis.RedisError as e:   # Redis refused this write (OOM, ACL, ...): dropped
                with self._lock:
                    self._writing = 0
                    self.counters.write_dropped += 1
                self._refused("write", e)
            except Exception:               # a bug must not stop the tier
                with self._lock:
                    self._writing = 0
                log.exception("internal error in the L2 writer")

    def _write(self, w: _Write) -> None:
        t0 = time.perf_counter()
        try:
            self._write_one(w)
        finally:
            with self._lock:
                self.counters.write_seconds += time.perf_counter() - t0

    def _write_one(self, w: _Write) -> None:
        if w.data is None and not self.host.l2_is_live(w.obj):
            with self._lock:
                self.counters.write_skipped += 1
            return
        self._writer_redis.put(w.rkey, w.data if w.data is not None else self.host.l2_view(w.obj))
        if w.data is None and not self.host.l2_is_live(w.obj):
            self._writer_redis.delete(w.rkey)   # evicted mid-send: its bytes may be torn
            with self._lock:
                self.counters.write_skipped += 1
            return
        with self._lock:
            self.counters.writes += 1
            self.counters.write_bytes += w.nbytes

    # ---- probes and promotion -----------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            p = self._probes.get()
            if p is None:
                return
            try:
                if self.up:
                    self._promote(p)
            except ERRORS as e:
                self._went_down(e)
            except redis.RedisError as e:   # Redis refused the probe or read: a miss
                self._refused("read", e)
            except Exception:
                log.exception("internal error in the L2 reader")
            finally:
                with self._lock:
                    self._probes_queued -= 1
                self._post(ProbeDone(p.waiter))

    def _promote(self, p: Probe) -> None:
        redis_ = self._reader_redis
        rkeys = self.rkeys(p.model, p.tp_rank, p.layout, p.keys)
        metas = redis_.probe(rkeys)
        with self._lock:
            self.counters.probes += 1
        nbytes = p.layout.chunk_bytes
        for key, rkey, meta in zip(p.keys, rkeys, metas):
            if time.monotonic() > p.deadline:
                return
            if meta is None:
                with self._lock:
                    self.counters.misses += 1
                return
            if meta.nbytes != nbytes:
                with self._lock:
                    self.counters.corrupt += 1
                return
            fill = self.host.l2_begin_fill(p.model, p.tp_rank, key, nbytes)
            if fill == "present":
                continue
            if fill == "full":
                return
            ok = False
            try:
                ok = redis_.read_into(rkey, meta, fill.view)
            finally:
                idents = self.host.l2_end_fill(fill.store_id, ok)
            with self._lock:
                if ok:
                    self.counters.hits += 1
                    self.counters.promoted_bytes += nbytes
                else:
                    self.counters.corrupt += 1
            if not ok:
                return
            self._post(Promoted(idents))

    # ---- health -------------------------------------------------------------------------
    def _went_down(self, e: BaseException) -> None:
        node = self._node_of(e)
        with self._cv:
            self.counters.errors += 1
            self._down_nodes.setdefault(node, time.time())
            if not self.up:
                return
            self.up = False
            self.counters.outages += 1
            self._down_since = time.monotonic()
            self._cv.notify_all()
        log.warning("L2 %s unreachable at node %s (%s: %s): serving from L1 only, writes "
                    "queued (bounded), retrying in the background", redacted(self.url), node,
                    type(e).__name__, str(e)[:200])

    def _node_of(self, e: BaseException) -> str:
        """The node an error names (NodeError); else the one Redis, or "cluster"."""
        node = getattr(e, "node", None)
        return node or ("cluster" if self._nodes.cluster else self._nodes.masters()[0])

    def _node_failed(self, e: BaseException) -> None:
        """A ping failed while down: remember the node (the first failure of each counts)."""
        node = self._node_of(e)
        with self._lock:
            first = node not in self._down_nodes
            self._down_nodes.setdefault(node, time.time())
        if first:
            log.warning("L2 %s: node %s does not answer either (%s: %s)", redacted(self.url),
                        node, type(e).__name__, str(e)[:200])

    def _last_failed(self) -> str | None:
        with self._lock:
            return next(reversed(self._down_nodes), None)

    def _went_up(self) -> None:
        with self._cv:
            if self.up:
                return
            self.up = True
            down = time.monotonic() - self._down_since
            depth = len(self._queue)
            nodes = ", ".join(self._down_nodes)
            self._down_nodes.clear()
            self._cv.notify_all()
        log.info("L2 %s reachable again after %.1f s (down: %s); catching up on %d queued "
                 "write(s)", redacted(self.url), down, nodes, depth)

    def masters(self) -> list[str]:
        """The nodes serving slots, as the tier last saw them (one for a single Redis)."""
        return self._nodes.masters()

    def _refused(self, op: str, e: Exception) -> None:
        """Redis answered with an error (it is up): count it; log each kind once."""
        kind = f"{op}:{str(e).split(' ', 1)[0][:40]}"
        with self._lock:
            self.counters.errors += 1
            first = kind not in self._logged and len(self._logged) < 64
            if first:
                self._logged.add(kind)
        if first:
            log.warning("L2 Redis %s refused a %s (%s: %s); counted in l2_errors, logged once",
                        redacted(self.url), op, type(e).__name__, str(e)[:200])

    def _post(self, event) -> None:
        self._events.put(event)
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):   # full: the loop is already due to wake
            pass
