"""Work too large for one turn of the control loop, done a slice at a time between requests.

Why a module of its own: the loop is single-threaded and every request waits behind what it
is doing, so a Hello (a connector's liveness check, with a timeout of seconds) waited 5.4 s
behind the Unregister of a model of a million objects, ~100 ms behind one 8,192-key store
that evicted as many, and 112 ms behind the pushes that a DELETE /cache run in another
thread had piled up for 64 key watches. As Redis does with UNLINK and lazy freeing, work
whose size a client chooses is cut into slices here, and the loop serves requests between
them:
- `Drop`: delete the ready objects of one model (one tp_rank) or of all models committed up
  to a stamp. DELETE /cache: its HTTP thread hands the job to the loop and waits for it.
  Unregister: answered at once with the count; the registration is gone at once (nothing
  new can arrive), the objects go in slices, and Register of that model answers `busy`
  until they have;
- `Prep`: a store of more than SLICE keys, or one that would have to evict more than a
  slice's worth of objects, is parked (bounded per session and in all, as parked lookups
  are) and prepared a few dozen objects at a time, evicting as it goes, until the pass's
  deadline (preparing.py: what other requests see meanwhile); then it is answered. Before,
  the loop evicted ahead in slices of 512 (10 ms each on a 2-core box) and then made all
  8,192 objects in one go (20-45 ms).
Each pass of the loop runs jobs for at most BUDGET_S (at least one slice) and then pushes
what changed to key watches, so a push is a slice's worth too.
Loop thread only, except `clear` (an HTTP thread), which takes the lock and wakes the loop.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvedit import protocol as P
from kvedit.layout import ModelLayout
from kvedit.server.index import Busy, Refused
from kvedit.server.preparing import Preparing
from kvedit.server.registry import Fail, quoted
from kvedit.server.waiters import TooManyWaits

log = logging.getLogger("kvedit.server")
SLICE = 512               # objects a Drop deletes per slice; larger stores are parked
BUDGET_S = 0.004          # loop time a pass spends on jobs (at least one slice)
ROOM_PER_CLIENT, ROOM_TOTAL = 4, 64   # parked stores of one session, of all
STOP_POLL_S = 0.5         # an HTTP thread waiting for its job checks for shutdown this often


@dataclass(eq=False)
class Drop:
    """Delete the ready objects of `model` (None: every model; `tp_rank` None: every rank)
    committed at or before stamp `upto`."""
    model: str | None
    tp_rank: int | None
    upto: int
    cursor: int | None = None
    deleted: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def step(self, svc) -> bool:
        n, self.cursor = svc.index.clear_some(self.model, self.upto, SLICE, self.tp_rank,
                                              self.cursor)
        self.deleted += n
        if self.cursor is not None:
            return False
        self.fail(svc)
        return True

    def fail(self, svc) -> None:
        """The job ends (done, or stopped by a bug): its waiter and the model are let go."""
        if self.tp_rank is not None:   # an Unregister: the model may be registered again
            svc._dropping.pop((self.model, self.tp_rank), None)
        self.done.set()


@dataclass(eq=False)
class Prep:
    """A parked store: prepared a few dozen objects at a time (evicting as it goes) until the
    pass's deadline, then answered (preparing.py says what others see meanwhile)."""
    ident: bytes
    rid: bytes
    req: P.PrepareStore
    holder: bytes
    st: Preparing | None = None
    lay: ModelLayout | None = None

    def step(self, svc) -> bool:
        r = self.req
        try:
            # unknown_model when unregistered since: until its first objects are made (then
            # Unregister answers busy), the model may go, or come back with another layout
            lay = svc._layout(r.model, r.tp_rank)
            if self.st is None:
                self.lay = lay
                self.st = svc.index.preparing(r.model, r.tp_rank, r.keys, lay.chunk_bytes,
                                              self.holder)
            elif lay != self.lay:
                raise Fail("unknown_model", f"model {quoted(r.model)} (tp_rank {r.tp_rank}) "
                                            f"was registered again with another layout while "
                                            f"this store was prepared: store again")
            if not self.st.run(svc._job_deadline):
                return False
            out = svc._slots(self.st.finish(), lay)
        except (Fail, Refused) as e:   # PoolFull, OverQuota, unknown_model
            if self.st is not None:
                self.st.cancel()       # every object made undone (done already for some)
            out = svc._error(e.code, e.message)
        svc.feed.flush()   # what it evicted reaches key watches before the reply, as always
        svc._send(self.ident, self.rid, out)
        return True

    def fail(self, svc) -> None:
        if self.st is not None:
            self.st.cancel()
        svc._send(self.ident, self.rid, svc._error("internal", "the store could not be "
                                                               "prepared; store again"))


class SlicedWork:
    """Mixed into Service: uses its index, lock, layouts, feed and `_answer`/`_send`/
    `_prepare`."""

    def _slices_init(self) -> None:
        self._jobs: deque = deque()
        self._job_deadline = 0.0   # when the pass running jobs ends (a Prep steps until it)
        self._dropping: dict[tuple[str, int], Drop] = {}
        self._kick_r, self._kick_w = socket.socketpair()   # an HTTP thread wakes the loop
        for s in (self._kick_r, self._kick_w):
            s.setblocking(False)

    def _slices_close(self) -> None:
        self._kick_r.close()
        self._kick_w.close()

    @property
    def kick_fd(self) -> int:
        return self._kick_r.fileno()

    def _kicked(self) -> None:
        try:
            while self._kick_r.recv(4096):
                pass
        except OSError:
            pass

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def _run_jobs(self) -> None:
        """One pass: jobs in turn for at most BUDGET_S, a push to watches after each slice."""
        end = self._job_deadline = time.monotonic() + BUDGET_S
        while self._jobs:
            job = self._jobs.popleft()
            try:
                more = not job.step(self)
            except Exception:   # a bug must not leave a waiter waiting, or the loop spinning
                log.exception("internal error in a sliced job; it is dropped")
                job.fail(self)
                more = False
            if more:
                self._jobs.append(job)
            self.feed.flush()
            if time.monotonic() >= end:
                return

    # ---- DELETE /cache (an HTTP thread) ------------------------------------------------
    def clear(self, model: str | None) -> int:
        """Delete every object (of one model) ready when it was asked -> how many: a Drop the
        loop runs a slice at a time while this thread waits. LookupError for a model that is
        not registered (nor being unregistered)."""
        with self.lock:
            if model is not None and not any(m == model for m, _ in self.layouts) and \
                    not any(m == model for m, _ in self._dropping):
                raise LookupError(f"model {model!r} is not registered")
            upto = self.index.newest_ready(model)
            if upto is None:
                return 0
            job = Drop(model, None, upto)
            self._jobs.append(job)
        try:
            self._kick_w.send(b"x")
        except OSError:   # the loop's buffer is full of kicks already: it is awake
            pass
        while not job.done.wait(STOP_POLL_S):
            if self.stop_requested:
                break
        return job.deleted

    # ---- Unregister (the loop) ---------------------------------------------------------
    def _unregister(self, model: str, tp: int) -> P.Count:
        self._layout(model, tp)
        n = self.index.droppable(model, tp)   # Busy while leased or being written
        del self.layouts[(model, tp)]
        upto = self.index.newest_ready(model)
        if n and upto is not None:
            job = Drop(model, tp, upto)
            if not job.step(self):   # more than a slice (of this rank, or of all ranks)
                self._dropping[(model, tp)] = job
                self._jobs.append(job)
        return P.Count(n=n)

    def _check_not_dropping(self, model: str, tp: int) -> None:
        job = self._dropping.get((model, tp))
        if job is not None:
            raise Busy(f"model {model!r} tp_rank {tp} was unregistered and its objects are "
                       f"being deleted ({job.deleted} so far, a slice at a time); register "
                       f"it again in a moment")

    # ---- large stores and stores that must evict much (the loop) ----------------------
    def _park_store(self, park: tuple[bytes, bytes, P.PrepareStore], holder: bytes,
                    slot: int) -> bool:
        """Park the store `park` (ident, rid, request) when preparing it is more than a
        slice's work: more than SLICE keys, or making room for its missing slots would evict
        more than a slice's worth -> True (the Prep job answers it). Past the bounds on
        parked stores: one that must evict much is refused (TooManyWaits), a large one is
        prepared in one go, as before there were slices."""
        index, req = self.index, park[2]
        free = index.counters.pool_free
        evicts = len(req.keys) * slot - free > SLICE * slot and index.evictable()
        if len(req.keys) <= SLICE and not evicts:
            return False
        parked = [j for j in self._jobs if isinstance(j, Prep)]
        mine = sum(1 for j in parked if j.holder == holder)
        if mine >= ROOM_PER_CLIENT or len(parked) >= ROOM_TOTAL:
            need = index.missing(req.model, req.tp_rank, req.keys) * slot
            if evicts and need - free > SLICE * slot:
                raise TooManyWaits(f"{mine} stores of this session and {len(parked)} in all "
                                   f"are waiting for the pool to make room (at most "
                                   f"{ROOM_PER_CLIENT} and {ROOM_TOTAL}): retry when one is "
                                   f"answered")
            return False
        self._jobs.append(Prep(*park, holder))
        return True
