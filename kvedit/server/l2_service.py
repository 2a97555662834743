"""The service's side of the second tier (a mixin of Service, kept out of service.py).

Loop side: a lookup whose leading keys miss L1 is parked (a waiter, as for wait_timeout > 0)
and a probe goes to the tier's reader; a promoted chunk's commit wakes waiters as any commit
does; when the probe ends, a lookup that did not ask to wait (wait_timeout 0) is answered with
what L1 now holds, and one that did keeps waiting for its keys or its deadline. Committed
stores are queued for write-behind (or, with --l2-write-on evict, evicted objects).
Thread side: the l2_* methods are the tier's narrow view of the index (each takes the lock).
"""
from __future__ import annotations

import logging
import time

from kvedit import auth
from kvedit import protocol as P
from kvedit.server.index import PoolFull, Refused
from kvedit.server.l2 import PROMOTE_FOR, Fill, FillRefusal, L2Tier, Probe, ProbeDone, Promoted
from kvedit.server.waiters import TooManyWaits, Waiter

log = logging.getLogger("kvedit.server")
L2_HOLDER = b"\x00kvedit-l2"   # holder of the promotion stores (no ZMQ identity looks like it)


class L2Methods:
    """Mixed into Service: uses its cfg, index, lock, arena, layouts, waiters, metrics."""

    def _l2_init(self, secret: bytes | None) -> None:
        cfg = self.cfg
        self.l2: L2Tier | None = None
        self._l2_answer_when_probed: set[Waiter] = set()
        if not cfg.l2_url:
            return
        self.l2 = L2Tier(self, cfg.l2_url, prefix=cfg.l2_prefix, ttl=cfg.l2_ttl,
                         timeout=cfg.l2_timeout,
                         max_queue_bytes=cfg.l2_queue_bytes,
                         write_on=cfg.l2_write_on,
                         mac_key=auth.l2_mac_key(secret) if cfg.l2_mac and secret else None)
        self.index.on_evict = self._l2_evicted

    # ---- loop side ----------------------------------------------------------------------
    def _l2_lookup(self, ident: bytes, holder: bytes, rid: bytes, req: P.Lookup, n: int):
        """A lookup with keys [n:] missing from L1: park it and probe L2 for them -> None
        (answered later), or a Count when L2 cannot help now."""
        now = time.monotonic()
        no_wait = req.wait_timeout <= 0
        wait = self.cfg.l2_lookup_wait if no_wait else req.wait_timeout
        lay = self.layouts[(req.model, req.tp_rank)]
        probe = Probe(req.model, req.tp_rank, lay, req.keys[n:], now + max(wait, PROMOTE_FOR))
        if no_wait and wait <= 0:   # promote in the background; this lookup answers now
            self.l2.probe(probe)
            return self._l2_count(req, n)
        w = Waiter(ident, rid, req, now + wait, holder=holder)
        try:
            self.waiters.add(w, n)
        except TooManyWaits:
            if not no_wait:
                raise
            self.l2.probe(probe)
            return self._l2_count(req, n)
        if no_wait:
            self._l2_answer_when_probed.add(w)
        probe.waiter = w
        self.l2.probe(probe)
        return None

    def _l2_count(self, req: P.Lookup, n: int) -> P.Count:
        self.metrics.hits.inc(n)
        self.metrics.misses.inc(len(req.keys) - n)
        return P.Count(n=n)

    def _l2_events(self) -> None:
        """Handle what the L2 threads posted (under the lock, on the loop thread)."""
        try:
            self._l2_handle(self.l2.events())
        except Exception:   # a bug must not take the server (and its data) down
            log.exception("internal error handling L2 events")

    def _l2_handle(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, Promoted):
                self._wake(ev.idents)
            elif isinstance(ev, ProbeDone) and ev.waiter is not None:
                w = ev.waiter
                if w in self._l2_answer_when_probed:
                    self._l2_answer_when_probed.discard(w)
                    if w.parked_on is not None:   # not answered yet (complete or deadline)
                        self._l2_answer_now(w)

    def _l2_answer_now(self, w: Waiter) -> None:
        for x in self.waiters.take(w.parked_on):
            n = self.index.leading_ready(x.req.model, x.req.tp_rank, x.req.keys)
            if x is w or n == len(x.req.keys):
                self._answer_waiter(x)
            else:
                self.waiters.park(x, n)

    def _l2_committed(self, objs: list) -> None:
        if self.l2 is not None and objs:
            o = objs[0]   # one store = one model and rank
            self.l2.write_behind(objs, self.layouts[(o.model, o.tp_rank)])

    def _l2_evicted(self, o) -> None:
        """The index evicts `o` (its slot is reused right after, on this thread)."""
        lay = self.layouts.get((o.model, o.tp_rank))
        if lay is not None and o.kind == "kv":   # captured queries stay in L1 only
            self.l2.evicting(o, lay, self.arena.view(o.offset, o.nbytes))

    # ---- thread side (the tier's L2Host; each takes the lock) ---------------------------
    def l2_is_live(self, obj) -> bool:
        with self.lock:
            return obj.live

    def l2_view(self, obj):
        return self.arena.view(obj.offset, obj.nbytes)

    def l2_begin_fill(self, model: str, tp_rank: int, key: bytes,
                      nbytes: int) -> Fill | FillRefusal:
        with self.lock:
            if (model, tp_rank) not in self.layouts:   # unregistered meanwhile
                return "full"
            try:
                r = self.index.prepare(model, tp_rank, [key], nbytes, L2_HOLDER)
            except PoolFull:
                return "full"
            if not r.missing:   # ready, or being written by a client or another fill
                self.index.abort(r.store_id, L2_HOLDER)
                return "present"
            return Fill(r.store_id, self.arena.view(r.offsets[0], nbytes))

    def l2_end_fill(self, store_id: int, ok: bool) -> list:
        """Publish (ok) or drop a promotion -> the idents now ready."""
        with self.lock:
            try:
                if not ok:
                    self.index.abort(store_id, L2_HOLDER)
                    return []
                c = self.index.commit(store_id, L2_HOLDER)
            except Refused as e:   # expired under a very slow Redis: dropped, not an error
                log.info("L2 promotion store %d ended: %s", store_id, e.message)
                return []
            return [o.ident for o in c.objs]
