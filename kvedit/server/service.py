"""The ZMQ ROUTER loop: decode a request, act on the index, reply. Single-threaded.

It never blocks on a client: replies go out with NOBLOCK semantics of ROUTER (a vanished
peer's reply is dropped), a lookup that waits is parked and answered by the commit that
completes it or by its deadline, and socket-mode bytes move on the data link's own threads.
Work per message is bounded (keys per request, message size, models), so one large request
cannot hold the loop for long; docs/protocol.md lists the limits and their error codes.

Work larger than a slice (a big Unregister or DELETE /cache, a store that must evict much)
is done a slice at a time between requests (slices.py).
The data link and HTTP call only the narrow methods at the bottom (begin_put/finish_put,
begin_get/finish_get, snapshot, page, clear, count_error); each takes the lock itself.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvedit import __version__, auth
from kvedit import protocol as P
from kvedit.layout import ModelLayout
from kvedit.query_contract import MAX_WINDOW
from kvedit.server.config import MIB, ServerConfig
from kvedit.server.datalink import DataLink
from kvedit.server.link_service import LinkMethods
from kvedit.server.index import Index, Prepared, Refused
from kvedit.server.key_feed import KeyFeed
from kvedit.server.l2_service import L2_HOLDER, L2Methods
from kvedit.server.metrics import LoopTurns, Metrics
from kvedit.server.peers import Peers, holder_of
from kvedit.server.pool import Allocator, Arena
from kvedit.server.registry import Fail, Registry, quoted
from kvedit.server.replies import ReplyQueues
from kvedit.server.slices import SlicedWork
from kvedit.server.trim import HeapTrim
from kvedit.server.waiters import TooManyWaits, Waiter, Waiters, wait_key

log = logging.getLogger("kvedit.server")
BURST = 256               # messages handled before housekeeping runs again
FREEZE_MIN_OBJECTS = 50_000  # below this a full GC pass is cheap enough
FREEZE_GROWTH = 1.1       # freeze again when the index grew by this factor
FREEZE_MADE = 4096        # ... or when this many objects were made since (churn)
KEY_BYTES = 64            # what a parked or leased key costs the heap, about (trim.py)
TRACEBACK_EVERY_S = 10.0  # an internal error logs its traceback at most this often


class Service(L2Methods, SlicedWork, LinkMethods, Registry):
    def __init__(self, cfg: ServerConfig, arena: Arena, instance: int,
                 secret: bytes | None = None):
        self.cfg, self.arena, self.instance = cfg, arena, instance
        self.index = Index(Allocator(arena.pool_offset, arena.pool_bytes), cfg.eviction_policy,
                           cfg.lease_ttl, cfg.write_ttl, quarantine_ttl=cfg.quarantine_seconds,
                           transfer_timeout=cfg.transfer_timeout, limits=cfg.quota_limits(),
                           exempt=frozenset({L2_HOLDER}), fence_gone=cfg.fence_gone_sessions)
        self.layouts: dict[tuple[str, int], ModelLayout] = {}
        self.lock = threading.Lock()        # shared with the data-link and HTTP threads
        self.metrics = Metrics(self.snapshot)
        self.turns = LoopTurns()            # the loop's CPU time per turn (metrics.py)
        self.started = time.time()
        self.waiters = Waiters(cfg.max_waits_per_client, cfg.max_waits_total,
                               max_keys=cfg.max_parked_keys)
        self._cuts: dict[int, Callable[[], None]] = {}  # store/lease id -> cut its transfer
        self.stop_requested = False
        self._frozen_objects = 0            # index size at the last gc.freeze()
        self._frozen_made = 0               # objects made (index.made) by then
        self.trim = HeapTrim()              # freed heap back to the OS after a burst
        self._tracebacks = (0.0, 0)         # (last traceback logged, errors since)
        self._slices_init()
        self.ctx = zmq.Context()
        self.authenticator = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection of a peer whose message is larger (no reply possible):
        # the client checks ServerInfo.max_message_bytes before sending.
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.message_bytes)
        if secret is not None:
            # the ZAP handler must run before the bind, or libzmq admits every CURVE client
            self.authenticator = auth.start_authenticator(self.ctx, secret)
            auth.curve_server(self.sock, secret)
        try:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
            self.peers = Peers(self.sock, cfg.max_zmq_conns_per_peer)
            self.data = DataLink(self, cfg, secret)
        except BaseException:
            self._close_zmq()
            raise
        self.info = P.ServerInfo(
            version=__version__, instance=instance, chunk_size=cfg.chunk_size,
            shm_name=cfg.shm_name, data_port=self.data.port, segment_bytes=arena.size,
            pool_offset=arena.pool_offset,
            pool_bytes=arena.pool_bytes, lazy=cfg.l1_use_lazy, eviction=cfg.eviction_policy,
            lease_ttl=cfg.lease_ttl, write_ttl=cfg.write_ttl,
            max_keys_per_request=cfg.max_keys_per_request,
            max_message_bytes=cfg.message_bytes, data_idle_timeout=cfg.data_idle_timeout)
        self.info.protocol = P.PROTOCOL
        self._l2_init(secret)   # second tier (--l2-url): kvedit/server/l2_service.py
        self.info.l2 = self.l2 is not None
        # clients' copies of the ready keys (key_feed.py)
        self.feed = KeyFeed(cfg.watch_limits(), send=self._send_bytes,
                            ready_after=self.index.pages.after,
                            delivered=self.peers.delivered, cut=self.peers.cut)
        self.index.feed = self.feed
        self.replies = ReplyQueues(int(cfg.reply_queue_mb * MIB),
                                   int(cfg.reply_queue_total_mb * MIB),
                                   delivered=self.peers.delivered, cut=self.peers.cut)

    # ---- loop -------------------------------------------------------------------------
    def run(self, wakeup_fd: int | None = None) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.peers.monitor, zmq.POLLIN)
        poller.register(self.kick_fd, zmq.POLLIN)   # an HTTP thread handed the loop a job
        if wakeup_fd is not None:   # a signal writes here, so poll returns at once
            poller.register(wakeup_fd, zmq.POLLIN)
        if self.l2 is not None:     # the L2 threads post promotions and finished probes
            self.l2.start()
            poller.register(self.l2.wake_fd, zmq.POLLIN)
        gc.collect()   # what start-up made (modules: 60k+ objects) is never scanned again:
        gc.freeze()    # gen-2 passes over it took 50 ms of loop turns (_freeze_gc)
        while not self.stop_requested:
            with self.lock:
                busy = self.feed.has_work() or self.has_jobs()
                timeout = 0 if busy else self._timeout_ms()
            events = dict(poller.poll(timeout))
            turn = time.thread_time()
            if self.kick_fd in events:
                self._kicked()
            if self.sock in events:
                for _ in range(BURST):  # drain a burst, then do housekeeping
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            if self.l2 is not None and self.l2.wake_fd in events:
                with self.lock:
                    self._l2_events()
                    self.feed.flush()
            try:
                gone = self.peers.poll()
                with self.lock:
                    self._connections_closed()
                    for holder in gone:
                        self._session_gone(holder)
                    self._housekeeping(time.monotonic())
                    self.feed.flush()   # what HTTP's threads changed, expiries
                    self._run_jobs()    # deletions and room for stores, a slice at a time
                    self.feed.work()    # snapshots of key watches, a slice at a time
            except Exception:  # a bug must not take the server (and its data) down
                log.exception("internal error in housekeeping")
            self.turns.observe(time.thread_time() - turn)

    def close(self) -> None:
        if self.l2 is not None:   # its threads read pool slots: stop them first
            self.l2.close()
        self.data.close()
        self._close_zmq()
        self._slices_close()

    def _close_zmq(self) -> None:
        if getattr(self, "peers", None) is not None:
            self.sock.disable_monitor()
            self.peers.close()
        self.sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    def _timeout_ms(self) -> int:
        deadlines = [d for d in (self.index.next_deadline(), self.waiters.next_deadline())
                     if d is not None]
        t = 1.0
        if deadlines:
            t = min(t, max(0.0, min(deadlines) - time.monotonic()))
        return max(1, int(t * 1000))

    def _housekeeping(self, now: float) -> None:
        for pid in self.index.expire(now).cut:  # in flight on the data link: cut the socket
            cut = self._cuts.pop(pid, None)
            if cut is not None:
                cut()
        for w in self.waiters.expired(now):
            self._answer_waiter(w)
        self.feed.expire(now)
        self._freeze_gc()
        self.trim.observe(KEY_BYTES * (self.waiters.keys + self.index.leased_keys())
                          + self.feed.total + self.replies.total
                          + (self.l2.queue_bytes if self.l2 is not None else 0))

    def _freeze_gc(self) -> None:
        """Keep GC passes off the index. CPython runs a gen-2 pass whenever long-lived
        objects grew by 25%, and at a million objects that pass holds the GIL (loop and HTTP)
        for a long pause (docs/protocol.md, "Observations behind the data path"). The index's
        objects form no cycles (freed by refcount), so moving them to the permanent
        generation loses nothing; a pass then scans only what came after. Freezing when the
        index grew is not enough: in a full pool every store evicts as many objects as it
        makes, the index does not grow, and CPython's young generation grows without a pass
        (a freed object takes one off the count that starts one), so the first pass that
        came scanned everything made since: 48 ms for 270k objects behind one 8,192-key
        commit, and the unfrozen survivors made each later gen-2 pass longer. So it freezes
        after every FREEZE_MADE objects made too (a collect of those few: ~1-2 ms)."""
        n, made = self.index.counters.objects, self.index.made
        if n >= FREEZE_MIN_OBJECTS and (n >= self._frozen_objects * FREEZE_GROWTH or
                                        made - self._frozen_made >= FREEZE_MADE):
            gc.collect(1)   # young cyclic garbage is not frozen with them (cheap: gens 0-1)
            gc.freeze()
            self._frozen_objects, self._frozen_made = n, made

    def _connections_closed(self) -> None:
        """Sockets whose connection closed: ZMQ dropped what was queued for them."""
        for ident in self.peers.take_closed():
            self.feed.disconnected(ident)
            self.replies.gone(ident)

    def _session_gone(self, holder: bytes) -> None:
        """The holder's last socket disconnected: let go of what only it could use."""
        self.waiters.drop_client(holder)
        self.feed.drop_holder(holder)
        self.index.session_gone(holder)

    # ---- messages ---------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if self.replies.doomed(ident):   # cut for not reading: what it sent meanwhile goes
            return
        try:
            gone = self.peers.seen(ident, frames[-1])
        except Exception:  # tracking is an optimisation: deadlines still bound everything
            log.exception("internal error tracking a peer")
            gone = []
        if len(frames) < 3:
            out, rid = self._error("malformed", f"expected frames [request id, message], got "
                                                f"{len(frames) - 1} frame(s)"), b""
        elif len(frames[1]) > P.MAX_RID_BYTES:
            out, rid = self._error("malformed", f"request id is {len(frames[1])} bytes, "
                                                f"expected at most {P.MAX_RID_BYTES}"), b""
        else:
            rid = frames[1].bytes
            with self.lock:
                self._connections_closed()   # before a new subscription on a new connection
                # pushes to key watches leave before any reply: before this request's (a
                # watch's snapshot starts after them) and after it (a Committed reply never
                # overtakes the push of its keys)
                self.feed.flush()
                out = self._dispatch(ident, rid, frames)
                self.feed.flush()
        if out is not None:
            self._send(ident, rid, out)
        if gone:
            with self.lock:
                for holder in gone:
                    try:
                        self._session_gone(holder)
                    except Exception:
                        log.exception("internal error letting go of a session")

    def _dispatch(self, ident: bytes, rid: bytes, frames: list[zmq.Frame]):
        try:
            req = P.request_decoder.decode(frames[2].buffer)
        except msgspec.ValidationError as e:
            if "$.keys" in str(e) and "length" in str(e):   # over the protocol's MAX_KEYS
                return self._error("too_many_keys", f"more than {P.MAX_KEYS} keys in one "
                                                    f"request, at most "
                                                    f"{self.cfg.max_keys_per_request} "
                                                    f"(--max-keys-per-request): split it")
            return self._error("malformed", f"cannot decode the message frame as a kvedit "
                                            f"request: {str(e)[:200]}")
        except (msgspec.DecodeError, RecursionError) as e:   # RecursionError: nested deep
            return self._error("malformed", f"cannot decode the message frame as a kvedit "
                                            f"request (msgpack map tagged by 't'): "
                                            f"{str(e)[:200]}")
        self.metrics.requests.labels(type(req).__name__).inc()
        return self._answer(lambda: self._handle(ident, rid, req, frames[3:]))

    def _answer(self, handle):
        """handle() -> its reply, or the error reply of what it raised."""
        try:
            return handle()
        except (Fail, Refused, TooManyWaits) as e:  # each carries its ErrorCode
            return self._error(e.code, e.message)
        except Exception as e:  # a bug must not take the server (and its data) down
            self._log_internal()
            return self._error("internal", f"{type(e).__name__}: {e}")

    def _log_internal(self) -> None:
        """A traceback now and then: one per request of a peer that triggers a bug would
        fill the disk (the rest are counted, kvedit_errors_total{code="internal"})."""
        last, since = self._tracebacks
        now = time.monotonic()
        if now - last < TRACEBACK_EVERY_S:
            self._tracebacks = (last, since + 1)
            return
        self._tracebacks = (now, 0)
        log.exception("internal error handling a request (%d more since the last traceback)",
                      since)

    def _error(self, code: P.ErrorCode, message: str) -> P.Error:
        self.metrics.errors.labels(code).inc()
        return P.Error(code=code, message=message)

    def _send(self, ident: bytes, rid: bytes, reply) -> None:
        self._send_bytes(ident, rid, P.encoder.encode(reply))

    def _send_bytes(self, ident: bytes, rid: bytes, body: bytes) -> None:
        """The one place a message leaves: what each socket was sent is counted, by the key
        feed for a watch's socket, else against the socket's reply bound (replies.py)."""
        n = len(rid) + len(body)
        if self.feed.count(ident, n) or self.replies.admit(ident, n):
            self.sock.send_multipart([ident, rid, body])

    def _handle(self, ident: bytes, rid: bytes, req, data: list[zmq.Frame]):
        if data:
            raise Fail("malformed", f"{type(req).__name__} came with {len(data)} extra frame(s);"
                                    f" expected [request id, message] (chunk bytes go through "
                                    f"shared memory or the data link)")
        holder = holder_of(ident)
        self.index.session_seen(holder)
        match req:
            case P.Hello(protocol=version):
                if version != P.PROTOCOL:
                    raise Fail("protocol", f"this client speaks kvedit protocol {version}, the "
                                           f"server (kvedit {__version__}) speaks "
                                           f"{P.PROTOCOL}: run the client and the server "
                                           f"from the same kvedit release")
                return self.info
            case P.Register(model=model, layout=layout):
                return self._register(model, layout)
            case P.Unregister(model=model, tp_rank=tp):
                n = self._unregister(model, tp)   # Busy while leased/in flight; sliced
                log.info("unregistered model %s tp_rank %d (%d object(s) deleted)",
                         quoted(model), tp, n.n)
                return n
            case P.GetLayout(model=model, tp_rank=tp):
                return P.LayoutReply(layout=self.layouts.get((model, tp)))
            case P.ListModels():
                return P.Models(models=self._models())
            case P.Lookup():
                return self._lookup(ident, holder, rid, req)
            case P.PrepareStore(kind="queries"):
                return self._prepare_queries(req, holder)
            case P.PrepareStore(model=model, keys=keys, tp_rank=tp, nbytes=0):
                return self._prepare(model, tp, keys, holder, park=(ident, rid, req))
            case P.PrepareStore(nbytes=n):
                raise Fail("malformed", f"prepare_store of kind 'kv' with nbytes {n}: a kv "
                                        f"object's size is the layout's chunk bytes; nbytes "
                                        f"is for kind 'queries' only")
            case P.Commit(store_id=sid):
                return self._commit(sid, holder)
            case P.Abort(store_id=sid):
                self.index.abort(sid, holder)
                return P.Ok()
            case P.Retrieve():
                return self._retrieve(req, holder)
            case P.Release(lease_id=lid):
                p = self.index.release(lid, holder)  # lease_expired/not_holder/busy: Refused
                self.metrics.retrieve_latency.observe(time.monotonic() - p.started)
                return P.Ok()
            case P.Delete(model=model, keys=keys, tp_rank=tp, kind=kind):
                self._layout(model, tp, keys)
                return P.Count(n=self.index.delete(model, tp, keys, kind))
            case P.WatchKeys(renew=False, model=model, tp_ranks=ranks):
                for r in sorted(set(ranks)):
                    self._layout(model, r)   # unknown_model: a watch of nothing would stay empty
                return self.feed.watch(ident, holder, rid, req)
            case P.WatchKeys():
                return self.feed.watch(ident, holder, rid, req)
            case P.Stats():
                return P.StatsReply(stats=self._snapshot())
        raise Fail("unknown_type", f"unhandled message type {type(req).__name__}")

    # ---- handlers ---------------------------------------------------------------------
    def _lookup(self, ident: bytes, holder: bytes, rid: bytes, req: P.Lookup):
        self._layout(req.model, req.tp_rank, req.keys)
        cfg = self.cfg
        if not 0 <= req.wait_timeout <= cfg.max_wait_seconds:  # also refuses NaN
            raise Fail("bad_wait", f"wait_timeout {req.wait_timeout} must be between 0 and "
                                   f"{cfg.max_wait_seconds} seconds (--max-wait-seconds)")
        n = self.index.leading_ready(req.model, req.tp_rank, req.keys, req.kind)
        if (n < len(req.keys) and req.kind == "kv" and self.l2 is not None
                and self.l2.can_probe()):
            return self._l2_lookup(ident, holder, rid, req, n)   # falls through to L2
        if n == len(req.keys) or req.wait_timeout <= 0:
            self.metrics.hits.inc(n)
            self.metrics.misses.inc(len(req.keys) - n)
            return P.Count(n=n)
        w = Waiter(ident, rid, req, time.monotonic() + req.wait_timeout, holder=holder)
        self.waiters.add(w, n)  # TooManyWaits past the per-client, total or keys bound
        return None  # answered later by a commit or the deadline

    def _answer_waiter(self, w: Waiter) -> None:
        n = self.index.leading_ready(w.req.model, w.req.tp_rank, w.req.keys, w.req.kind)
        self.metrics.hits.inc(n)
        self.metrics.misses.inc(len(w.req.keys) - n)
        self._send(w.ident, w.rid, P.Count(n=n))

    def _wake(self, idents) -> None:
        if not len(self.waiters):   # nothing parked: a large commit need not look
            return
        for ident in idents:
            for w in self.waiters.take(ident):
                n = self.index.leading_ready(w.req.model, w.req.tp_rank, w.req.keys,
                                             w.req.kind)
                if n == len(w.req.keys):
                    self._answer_waiter(w)
                else:
                    self.waiters.park(w, n)

    def _prepare(self, model: str, tp: int, keys: list[bytes], holder: bytes, park=None):
        """A kv store: its slots, or None when `park` (ident, rid, request) was parked until
        the pool has made room for it (slices.py: it is answered then)."""
        lay = self._layout(model, tp, keys)
        need = len(set(keys)) * lay.chunk_bytes
        if need > self.arena.pool_bytes:
            raise Fail("too_large", f"store of {len(keys)} chunk(s) x {lay.chunk_bytes} bytes = "
                                    f"{need} bytes is larger than the pool "
                                    f"({self.arena.pool_bytes} bytes, --l1-size-gb)")
        if park is not None and self._park_store(park, holder,
                                                 self.index.slot_bytes(lay.chunk_bytes)):
            return None
        r = self.index.prepare(model, tp, keys, lay.chunk_bytes, holder)  # Refused: pool_full
        return self._slots(r, lay)

    def _slots(self, r: Prepared, lay: ModelLayout) -> P.StoreSlots:
        return P.StoreSlots(store_id=r.store_id, missing=r.missing, offsets=r.offsets,
                            present=r.present, layout=lay, instance=self.instance)

    def _prepare_queries(self, req: P.PrepareStore, holder: bytes):
        """One captured-queries object (kind "queries"): any size up to --max-query-bytes,
        replacing a ready one under the same key (Index.prepare)."""
        lay = self._layout(req.model, req.tp_rank, req.keys)
        if len(req.keys) != 1:
            raise Fail("malformed", f"prepare_store of kind 'queries' takes exactly one key, "
                                    f"got {len(req.keys)}")
        cap = min(self.cfg.query_bytes(lay), self.arena.pool_bytes)
        if not 0 < req.nbytes <= cap:
            flag = self.cfg.max_query_bytes or (f"0 = {MAX_WINDOW} rows of the model's "
                                                f"queries, {self.cfg.query_bytes(lay)} bytes")
            raise Fail("too_large" if req.nbytes > 0 else "malformed",
                       f"a queries object of {req.nbytes} bytes; expected 1..{cap} bytes "
                       f"(--max-query-bytes {flag}; pool {self.arena.pool_bytes}): capture "
                       f"a smaller window")
        r = self.index.prepare(req.model, req.tp_rank, req.keys, req.nbytes, holder,
                               kind="queries")  # Refused: pool_full
        return P.StoreSlots(store_id=r.store_id, missing=r.missing, offsets=r.offsets,
                            present=r.present, layout=lay, instance=self.instance,
                            nbytes=req.nbytes)

    def _commit(self, sid: int, holder: bytes):
        p = self.index.commit(sid, holder)
        self.metrics.store_bytes.inc(p.nbytes)
        self.metrics.store_latency.observe(time.monotonic() - p.started)
        self._wake(wait_key(o.model, o.tp_rank, o.key, o.kind) for o in p.objs)
        self._l2_committed([o for o in p.objs if o.kind == "kv"])   # write-behind to L2
        return P.Committed(stored=len(p.objs))

    def _retrieve(self, req: P.Retrieve, holder: bytes):
        lay = self._layout(req.model, req.tp_rank, req.keys)
        r = self.index.lease(req.model, req.tp_rank, req.keys, holder, req.kind,
                             ordered=req.with_data)   # Refused: over_quota
        self.metrics.hits.inc(len(r.objs))
        self.metrics.misses.inc(len(req.keys) - len(r.objs))
        self.metrics.retrieve_bytes.inc(r.nbytes)
        # with_data: the client GETs the bytes on the data link, which then releases the lease
        reply = P.Leased(lease_id=r.lease_id, count=len(r.objs), layout=lay,
                         instance=self.instance, offsets=[] if req.with_data else r.offsets,
                         sizes=[o.nbytes for o in r.objs] if req.kind == "queries" else [])
        if req.with_data and not r.objs:
            self.index.release(r.lease_id, holder)
        return reply

    # ---- introspection for HTTP and the metrics collector (each takes the lock) --------
    def snapshot(self) -> dict:
        """O(1): what /status, Stats and /metrics show."""
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        return self.index.snapshot() | {
            "models": len(self.layouts), "waiting_lookups": len(self.waiters),
            "parked_keys": self.waiters.keys, "data_conns": self.data.connections(),
            "zmq_conns": self.peers.connected(), "zmq_conns_refused": self.peers.refused,
            "heap_trims": self.trim.trims,
        } | self.turns.snapshot() | {
            "transfer_mode": "shm" if self.cfg.shm_name else "socket",
            "uptime_s": round(time.time() - self.started, 3),
        } | self.feed.snapshot() | self.replies.snapshot() | (
            self.l2.snapshot() if self.l2 is not None else {})

    def page(self, model: str | None, after: int | None, limit: int):
        """O(limit): one page of ready objects for GET /cache (see Index.page)."""
        with self.lock:
            return self.index.page(model, after, limit)
