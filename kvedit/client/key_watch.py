"""A client's copy of which "kv" keys of one model the server holds ready.

Made by `KVClient.watch_keys`; the server side is kvedit.server.key_feed (why it exists, and
the order it guarantees). The copy is a hint that errs only one way that matters: the
connector answers "not in the server" from it without asking (`lacks`), and asks the server
for anything the copy says is there. So the copy must not miss a key the server holds; every
way it could is turned into "don't trust the copy" (`trusted` False, every lookup asks the
server) until a fresh snapshot arrives:
- before the first snapshot, and after a subscription is sent again;
- a push lost (its seq skips one: the client's receive queue was full and the server dropped
  it) or a renewal whose seq says one was lost;
- a renewal the server no longer knows (restarted, or the watch passed its TTL unrenewed);
- no answer to a subscription or renewal within ANSWER_S (a stalled or vanished server).

Single-threaded: `sync()` reads what has arrived without blocking (call it before using the
copy); the socket is the caller's KVClient's, closed with it.
"""
from __future__ import annotations

import logging
import time

import zmq

from kvedit import protocol as P

log = logging.getLogger("kvedit.client")

RENEW_S = 1.0          # renew the watch this often (the server ends it after 30 s without)
ANSWER_S = 5.0         # a subscription or renewal unanswered this long: subscribe again
RCV_HWM = 100_000      # pushes queued here before the server drops some (then: a new snapshot)


class KeyWatch:
    def __init__(self, client, sock: zmq.Socket, model: str, tp_ranks: list[int],
                 clock=time.monotonic):
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        self.client = client     # the KVClient whose socket this is
        self.sock, self.model, self.ranks, self.clock = sock, model, list(tp_ranks), clock
        self.keys: dict[int, set[bytes]] = {r: set() for r in self.ranks}
        self.trusted = False
        self.closed = False      # refused by the server (a bound): the copy is never used
        self.epoch = 0
        self.seq = 0
        self.renewed_at = 0.0    # when the last renewal went out
        self.acked = True        # its answer came
        self.resyncs = 0         # subscriptions sent again (lost pushes, restarts, stalls)
        self._subscribe()

    # ---- use -------------------------------------------------------------------------
    def lacks(self, keys: list[list[bytes]], first: int) -> bool:
        """Whether the server certainly lacks chunk `first` on some rank (keys: per rank, in
        `tp_ranks` order): False whenever the copy is not trusted."""
        if not self.trusted:
            return False
        return any(k[first] not in self.keys[r] for r, k in zip(self.ranks, keys))

    def sync(self) -> None:
        """Apply what the server sent; renew the watch when due. Never blocks."""
        if self.closed:
            return
        try:
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on(P.reply_decoder.decode(frames[-1].buffer))
            now = self.clock()
            if not self.acked and now - self.renewed_at > ANSWER_S:
                self._resync("no answer within %.0f s" % ANSWER_S)
            elif self.acked and self.trusted and now - self.renewed_at > RENEW_S:
                self._send(P.WatchKeys(model=self.model, tp_ranks=self.ranks,
                                       epoch=self.epoch, renew=True))
                self.renewed_at, self.acked = now, False
        except zmq.ZMQError as e:   # the client was closed under us
            self.trusted, self.closed = False, True
            log.debug("key watch of %s ended: %s", self.model, e)

    # ---- messages --------------------------------------------------------------------
    def _on(self, msg) -> None:
        if isinstance(msg, P.Error):
            self.trusted, self.closed = False, True
            log.info("kvedit: the server refused a key watch of %s (%s): %s; lookups ask it",
                     self.model, msg.code, msg.message)
            return
        if getattr(msg, "epoch", None) != self.epoch:
            return   # an earlier subscription's
        if isinstance(msg, P.KeySnapshot):
            self.keys = {r: set(msg.keys.get(r, ())) for r in self.ranks}
            self.seq, self.trusted, self.acked = 0, True, True
            self.renewed_at = self.clock()
        elif isinstance(msg, P.KeyEvents):
            if not self.trusted:
                return   # before the snapshot: it holds these already
            if msg.seq != self.seq + 1:
                return self._resync(f"push {msg.seq} after {self.seq}: some were lost")
            self.seq = msg.seq
            for r, ks in msg.added.items():
                if r in self.keys:
                    self.keys[r].update(ks)
            for r, ks in msg.removed.items():
                if r in self.keys:
                    self.keys[r].difference_update(ks)
        elif isinstance(msg, P.WatchAck):
            self.acked = True
            if msg.seq < 0:
                self._resync("the server does not know this watch (restarted or expired)")
            elif msg.seq != self.seq:
                # pushes are sent before the ack on the same connection: a lower seq here
                # means some were dropped
                self._resync(f"renewal says push {msg.seq}, {self.seq} arrived")

    def _resync(self, why: str) -> None:
        log.debug("kvedit key watch of %s: subscribing again (%s)", self.model, why)
        self.resyncs += 1
        self._subscribe()

    def _subscribe(self) -> None:
        self.epoch += 1
        self.trusted, self.acked = False, False
        self.renewed_at = self.clock()
        self._send(P.WatchKeys(model=self.model, tp_ranks=self.ranks, epoch=self.epoch))

    def _send(self, msg) -> None:
        try:
            self.sock.send_multipart([b"watch", P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:   # not connected yet: unanswered, so sent again after ANSWER_S
            self.trusted = False
