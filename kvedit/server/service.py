"""The ZMQ ROUTER loop: decode a request, act on the index, reply. Single-threaded.

It never blocks on a client: replies go out with NOBLOCK semantics of ROUTER (a vanished
peer's reply is dropped), a lookup that waits is parked and answered by the commit that
completes it or by its deadline, and socket-mode bytes move on the data link's own threads.
"""
from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from kvedit import __version__
from kvedit import protocol as P
from kvedit.layout import ModelLayout
from kvedit.server.config import ServerConfig
from kvedit.server.datalink import DataLink
from kvedit.server.index import Index, PoolFull
from kvedit.server.metrics import Metrics
from kvedit.server.pool import Allocator, Arena
from kvedit.server.waiters import Waiter, Waiters

log = logging.getLogger("kvedit.server")
MAX_WAIT = 3600.0  # longest server-side lookup wait, seconds


class Fail(Exception):
    """Raised by a handler: becomes an Error(code, message) reply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Service:
    def __init__(self, cfg: ServerConfig, arena: Arena, instance: int):
        self.cfg, self.arena, self.instance = cfg, arena, instance
        self.index = Index(Allocator(arena.pool_offset, arena.pool_bytes), cfg.eviction_policy,
                           cfg.lease_ttl, cfg.write_ttl)
        self.layouts: dict[tuple[str, int], ModelLayout] = {}
        self.lock = threading.Lock()        # shared with the HTTP threads
        self.metrics = Metrics(self.state)
        self.started = time.time()
        self.waiters = Waiters()
        self._expired = (0, 0)
        self.stop_requested = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
        self.data = DataLink(self, cfg.host)
        self.info = P.ServerInfo(
            version=__version__, instance=instance, chunk_size=cfg.chunk_size,
            shm_name=cfg.shm_name, data_port=self.data.port, segment_bytes=arena.size,
            pool_offset=arena.pool_offset,
            pool_bytes=arena.pool_bytes, lazy=cfg.l1_use_lazy, eviction=cfg.eviction_policy,
            lease_ttl=cfg.lease_ttl, write_ttl=cfg.write_ttl)

    # ---- loop -------------------------------------------------------------------------
    def run(self, wakeup_fd: int | None = None) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if wakeup_fd is not None:   # a signal writes here, so poll returns at once
            poller.register(wakeup_fd, zmq.POLLIN)
        while not self.stop_requested:
            with self.lock:
                timeout = self._timeout_ms()
            events = dict(poller.poll(timeout))
            if self.sock in events:
                for _ in range(256):  # drain a burst, then do housekeeping
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            with self.lock:
                self._housekeeping(time.monotonic())

    def close(self) -> None:
        self.data.close()
        self.sock.close(linger=0)
        self.ctx.term()

    def _timeout_ms(self) -> int:
        deadlines = [d for d in (self.index.next_deadline(), self.waiters.next_deadline())
                     if d is not None]
        t = 1.0
        if deadlines:
            t = min(t, max(0.0, min(deadlines) - time.monotonic()))
        return max(1, int(t * 1000))

    def _housekeeping(self, now: float) -> None:
        self.index.expire(now)
        el, es = self.index.expired_leases, self.index.expired_stores
        if (el, es) != self._expired:
            self.metrics.expired.labels("lease").inc(el - self._expired[0])
            self.metrics.expired.labels("store").inc(es - self._expired[1])
            self._expired = (el, es)
        for w in self.waiters.expired(now):
            self._answer_waiter(w)

    # ---- messages ---------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) < 3:
            return self._send(ident, b"", P.Error(
                code="malformed", message=f"expected frames [request id, message], got "
                                          f"{len(frames) - 1} frame(s)"))
        rid = frames[1].bytes
        if len(rid) > P.MAX_RID_BYTES:
            return self._send(ident, b"", P.Error(
                code="malformed", message=f"request id is {len(rid)} bytes, expected at most "
                                          f"{P.MAX_RID_BYTES}"))
        with self.lock:
            try:
                req = P.request_decoder.decode(frames[2].buffer)
                self.metrics.requests.labels(type(req).__name__).inc()
                out = self._handle(ident, rid, req, frames[3:])
            except msgspec.DecodeError as e:
                out = self._error("malformed", f"cannot decode the message frame as a kvedit "
                                               f"request (msgpack map tagged by 't'): {e}")
            except Fail as e:
                out = self._error(e.code, e.message)
            except Exception as e:  # a bug must not take the server (and its data) down
                log.exception("internal error handling a request")
                out = self._error("internal", f"{type(e).__name__}: {e}")
        if out is not None:
            self._send(ident, rid, out)

    def _error(self, code: str, message: str):
        self.metrics.errors.labels(code).inc()
        return P.Error(code=code, message=message)

    def _send(self, ident: bytes, rid: bytes, reply) -> None:
        self.sock.send_multipart([ident, rid, P.encoder.encode(reply)])

    def _handle(self, ident: bytes, rid: bytes, req, data: list[zmq.Frame]):
        if data:
            raise Fail("malformed", f"{type(req).__name__} came with {len(data)} extra frame(s);"
                                    f" expected [request id, message] (chunk bytes go through "
                                    f"shared memory or the data link)")
        match req:
            case P.Hello():
                return self.info
            case P.Register(model=model, layout=layout):
                return self._register(model, layout)
            case P.GetLayout(model=model, tp_rank=tp):
                return P.LayoutReply(layout=self.layouts.get((model, tp)))
            case P.ListModels():
                models: dict[str, list[ModelLayout]] = {}
                for (m, _), lay in sorted(self.layouts.items()):
                    models.setdefault(m, []).append(lay)
                return P.Models(models=models)
            case P.Lookup():
                return self._lookup(ident, rid, req)
            case P.PrepareStore(model=model, keys=keys, tp_rank=tp):
                return self._prepare(model, tp, keys)
            case P.Commit(store_id=sid):
                return self._commit(sid)
            case P.Abort(store_id=sid):
                p = self.index.stores.get(sid)
                if p is None:
                    raise Fail("unknown_store", self.unknown_store(sid))
                if p.busy:  # its slots are being written by the data link right now
                    raise Fail("busy", f"store {sid} is receiving data on the data link")
                self.index.abort(sid)
                return P.Ok()
            case P.Retrieve():
                return self._retrieve(req)
            case P.Release(lease_id=lid):
                p = self.index.leases.get(lid)
                if p is None:
                    raise Fail("unknown_lease", f"lease {lid} is unknown, already released, or "
                                                f"expired (lease TTL {self.cfg.lease_ttl} s)")
                if p.busy:  # the data link is sending from it and releases it when done
                    raise Fail("busy", f"lease {lid} is being sent on the data link")
                self.release(lid)
                return P.Ok()
            case P.Delete(model=model, keys=keys, tp_rank=tp):
                self._layout(model, tp, keys)
                return P.Count(n=self.index.delete(model, tp, keys))
            case P.Stats():
                return P.StatsReply(stats=self.state())
        raise Fail("unknown_type", f"unhandled message type {type(req).__name__}")

    # ---- handlers ---------------------------------------------------------------------
    def _layout(self, model: str, tp: int, keys: list[bytes] = ()) -> ModelLayout:
        for i, k in enumerate(keys):
            if not 0 < len(k) <= P.MAX_KEY_BYTES:
                raise Fail("bad_key", f"key {i} is {len(k)} bytes, expected 1..{P.MAX_KEY_BYTES}"
                                      f" (kvedit.keys makes 16-byte keys)")
        lay = self.layouts.get((model, tp))
        if lay is None:
            known = sorted(f"{m}[tp_rank {r}]" for m, r in self.layouts)
            raise Fail("unknown_model", f"model {model!r} (tp_rank {tp}) is not registered; "
                                        f"registered: {known or 'none'}")
        return lay

    def _register(self, model: str, layout: ModelLayout):
        if not model:
            raise Fail("bad_layout", "model name must be a non-empty string")
        try:
            layout.validate()
        except ValueError as e:
            raise Fail("bad_layout", str(e)) from None
        if layout.chunk_size != self.cfg.chunk_size:
            raise Fail("bad_layout", f"layout.chunk_size {layout.chunk_size} does not match the "
                                     f"server's --chunk-size {self.cfg.chunk_size}")
        if layout.chunk_bytes > self.arena.pool_bytes:
            raise Fail("too_large", f"one chunk of this layout is {layout.chunk_bytes} bytes, "
                                    f"larger than the whole pool ({self.arena.pool_bytes} bytes)")
        old = self.layouts.get((model, layout.tp_rank))
        if old is not None and old != layout:
            raise Fail("layout_conflict", f"model {model!r} tp_rank {layout.tp_rank} is already "
                                          f"registered with {old}, not {layout}")
        if old is None:
            self.layouts[(model, layout.tp_rank)] = layout
            log.info("registered model %r tp_rank %d: chunk %s %s (%d bytes)", model,
                     layout.tp_rank, layout.chunk_shape, layout.dtype, layout.chunk_bytes)
        return P.Ok()

    def _lookup(self, ident: bytes, rid: bytes, req: P.Lookup):
        self._layout(req.model, req.tp_rank, req.keys)
        if not 0 <= req.wait_timeout <= MAX_WAIT:  # also refuses NaN
            raise Fail("bad_wait", f"wait_timeout {req.wait_timeout} must be between 0 and "
                                   f"{MAX_WAIT} seconds")
        n = self.index.leading_ready(req.model, req.tp_rank, req.keys)
        if n == len(req.keys) or req.wait_timeout <= 0:
            self.metrics.hits.inc(n)
            self.metrics.misses.inc(len(req.keys) - n)
            return P.Count(n=n)
        self.waiters.add(Waiter(ident, rid, req, time.monotonic() + req.wait_timeout), n)
        return None  # answered later by a commit or the deadline

    def _answer_waiter(self, w: Waiter) -> None:
        n = self.index.leading_ready(w.req.model, w.req.tp_rank, w.req.keys)
        self.metrics.hits.inc(n)
        self.metrics.misses.inc(len(w.req.keys) - n)
        self._send(w.ident, w.rid, P.Count(n=n))

    def _wake(self, idents) -> None:
        for ident in idents:
            for w in self.waiters.take(ident):
                n = self.index.leading_ready(w.req.model, w.req.tp_rank, w.req.keys)
                if n == len(w.req.keys):
                    self._answer_waiter(w)
                else:
                    self.waiters.park(w, n)

    def _prepare(self, model: str, tp: int, keys: list[bytes]):
        lay = self._layout(model, tp, keys)
        need = len(set(keys)) * lay.chunk_bytes
        if need > self.arena.pool_bytes:
            raise Fail("too_large", f"store of {len(keys)} chunk(s) x {lay.chunk_bytes} bytes = "
                                    f"{need} bytes is larger than the pool "
                                    f"({self.arena.pool_bytes} bytes, --l1-size-gb)")
        try:
            sid, missing, offsets, present = self.index.prepare(model, tp, keys, lay.chunk_bytes)
        except PoolFull as e:
            raise Fail("pool_full", str(e)) from None
        return P.StoreSlots(store_id=sid, missing=missing, offsets=offsets, present=present,
                            layout=lay, instance=self.instance)

    def unknown_store(self, sid: int) -> str:
        return (f"store {sid} is unknown, already committed/aborted, or expired "
                f"(write TTL {self.cfg.write_ttl} s)")

    def _commit(self, sid: int):
        p = self.index.stores.get(sid)
        if p is None:
            raise Fail("unknown_store", self.unknown_store(sid))
        if p.busy:
            raise Fail("busy", f"store {sid} is still receiving its data on the data link")
        self.index.commit(sid)
        nbytes = sum(o.nbytes for o in p.objs)
        self.metrics.store_bytes.inc(nbytes)
        self.metrics.store_latency.observe(time.monotonic() - p.started)
        self._wake(o.ident for o in p.objs)
        return P.Committed(stored=len(p.objs))

    def _retrieve(self, req: P.Retrieve):
        lay = self._layout(req.model, req.tp_rank, req.keys)
        lid, objs = self.index.lease(req.model, req.tp_rank, req.keys)
        self.metrics.hits.inc(len(objs))
        self.metrics.misses.inc(len(req.keys) - len(objs))
        self.metrics.retrieve_bytes.inc(sum(o.nbytes for o in objs))
        # with_data: the client GETs the bytes on the data link, which then releases the lease
        reply = P.Leased(lease_id=lid, count=len(objs), layout=lay, instance=self.instance,
                         offsets=[] if req.with_data else [o.offset for o in objs])
        if req.with_data and not objs:
            self.release(lid)
        return reply

    def release(self, lid: int) -> None:
        try:
            p = self.index.release(lid)
        except KeyError:  # expired meanwhile
            return
        self.metrics.retrieve_latency.observe(time.monotonic() - p.started)

    # ---- introspection (also used by HTTP, under the lock) ----------------------------
    def state(self) -> dict:
        a = self.index.alloc
        return self.index.counts() | {
            "pool_bytes": a.capacity, "pool_used": a.used, "pool_free": a.capacity - a.used,
            "models": len(self.layouts), "waiting_lookups": len(self.waiters),
            "evictions": self.index.evictions,
            "expired_leases": self.index.expired_leases,
            "expired_stores": self.index.expired_stores,
            "transfer_mode": "shm" if self.cfg.shm_name else "socket",
            "uptime_s": round(time.time() - self.started, 3),
        }
