"""The service's side of the data link (a mixin of Service, kept out of service.py).

The data link's threads move chunk bytes straight into and out of pool slots; they reach the
index only through these narrow methods, each of which takes the service lock: begin a
transfer (the slots' views, or why not), finish it, count an error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvedit import protocol as P
from kvedit.server.index import Refused


@dataclass(slots=True)
class Transfer:
    """What begin_put/begin_get give the data link: the slots' views, or why not."""
    views: list = field(default_factory=list)
    error: tuple[P.ErrorCode, str] | None = None


class LinkMethods:
    """Mixed into Service: uses its lock, index, arena, metrics and `_cuts`."""

    def begin_put(self, store_id: int, holder: bytes, nbytes: int, cut) -> Transfer:
        """The slots a PUT of `nbytes` may write, if `holder` holds that store."""
        with self.lock:
            try:
                t = self.index.begin_put(store_id, holder)
            except Refused as e:
                return Transfer(error=(e.code, f"PUT: {e.message}"))
            if nbytes != t.nbytes:
                self.index.finish_put(store_id, False)
                return Transfer(error=("malformed", f"PUT of store {store_id} announces {nbytes} "
                                                    f"bytes, expected {t.nbytes} "
                                                    f"({len(t.slots)} missing chunk(s) of the "
                                                    f"layout); the store is void"))
            self._cuts[store_id] = cut
            return Transfer(views=[self.arena.view(x.offset, x.nbytes) for x in t.slots])

    def finish_put(self, store_id: int, ok: bool) -> tuple[P.ErrorCode, str] | None:
        """The PUT ended; None when its bytes count (the store may be committed)."""
        with self.lock:
            self._cuts.pop(store_id, None)
            if not ok:
                self.metrics.transfers_failed.labels("put").inc()
            if not self.index.finish_put(store_id, ok) and ok:  # cut as the last bytes came in
                return "store_expired", (f"PUT: store {store_id} passed its deadline during the "
                                         f"transfer and was dropped; store again")
        return None

    def begin_get(self, lease_id: int, holder: bytes, cut) -> Transfer:
        """The slots a GET sends, if `holder` holds that lease."""
        with self.lock:
            try:
                t = self.index.begin_get(lease_id, holder)
            except Refused as e:
                return Transfer(error=(e.code, f"GET: {e.message}"))
            self._cuts[lease_id] = cut
            return Transfer(views=[self.arena.view(x.offset, x.nbytes) for x in t.slots])

    def finish_get(self, lease_id: int, ok: bool) -> None:
        """The GET ended (sent, or cut): the lease is released either way."""
        with self.lock:
            self._cuts.pop(lease_id, None)
            if not ok:
                self.metrics.transfers_failed.labels("get").inc()
            released = self.index.finish_get(lease_id, ok)
            if ok and released is not None:
                self.metrics.retrieve_latency.observe(time.monotonic() - released.started)

    def count_error(self, code: P.ErrorCode) -> None:
        self.metrics.errors.labels(code).inc()
