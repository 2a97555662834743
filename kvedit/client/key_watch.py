"""A client's copy of which "kv" keys of one model the server holds ready.

Made by `KVClient.watch_keys`; the server side is kvedit.server.key_feed (why it exists, the
order it guarantees, and its bounds). The copy is a hint that errs only one way that
matters: the connector answers "not in the server" from it without asking (`lacks`), and
asks the server for anything the copy says is there. So the copy must not miss a key the
server holds; every way it could is turned into "don't trust the copy" (`trusted` False,
every lookup asks the server) until a fresh snapshot has arrived whole:
- before the snapshot's last part, and after a subscription is sent again;
- a message lost (its seq skips one: a queue was full and the server dropped it), or a
  renewal whose seq says one was lost;
- a renewal the server no longer knows (restarted, the watch passed its TTL, or the server
  dropped it because this client fell too far behind: seq -1);
- no answer to a subscription or renewal within ANSWER_S (a stalled or vanished server;
  the client then also reads its secret again, in case the server restarted with another),
  or the client heard from a restarted server (a new instance) since it subscribed;
- a subscription refused (the server's watch bounds, or the model not registered yet: the
  connector subscribes before its workers register the model): tried again after a backoff
  that doubles from RETRY_MIN_S to RETRY_MAX_S.
The snapshot arrives in parts, and what changes meanwhile arrives between them, all in seq
order; the copy applies each as it comes. Renewals acknowledge the last seq applied (the
server sends a watch only so much it has not acknowledged): every RENEW_S, and during a
snapshot every ACK_BYTES applied.

Single-threaded: `sync()` reads what has arrived without blocking (call it before using the
copy); the socket is the caller's KVClient's, closed with it.

A `KeyListener` (optional) hears what the copy learns, from inside `sync()`: each push applied
while the copy is trusted, and each time a fresh snapshot makes it trusted again (then the
whole copy, to compare with what the listener believed: changes while it was not trusted are
not told one by one, as some may have been lost). The connector's KV events
(kvedit.vllm.tier_events) are such a listener.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Protocol

import zmq

from kvedit import protocol as P

log = logging.getLogger("kvedit.client")

RENEW_S = 1.0          # renew the watch this often (the server ends it after 30 s without)
ANSWER_S = 2.0         # a subscription or renewal unanswered this long: subscribe again
ACK_BYTES = 1 << 20    # during a snapshot, acknowledge after applying this much
RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0   # after a refused subscription
RCV_HWM = 100_000      # messages queued here before the server drops some (then: resubscribe)


class KeyListener(Protocol):
    def keys_changed(self, added: dict[int, list[bytes]],
                     removed: dict[int, list[bytes]]) -> None:
        """A push applied to a trusted copy: keys (by tp rank) that became ready or went."""

    def keys_resynced(self, keys: dict[int, set[bytes]]) -> None:
        """A fresh snapshot is whole: `keys` is the copy (by tp rank; do not keep it)."""


class KeyWatch:
    def __init__(self, client, model: str, tp_ranks: list[int], clock=time.monotonic,
                 listener: KeyListener | None = None):
        self.client = client     # the KVClient whose socket this is
        self.model, self.ranks, self.clock = model, list(tp_ranks), clock
        self.listener = listener
        self.sock = client.open_socket(rcvhwm=RCV_HWM)
        self._credentials = client.credentials
        self.keys: dict[int, set[bytes]] = {r: set() for r in self.ranks}
        self.trusted = False
        self.closed = False      # the client was closed: the copy is never used again
        self.refused: str | None = None   # the last refusal's code, while waiting to retry
        self.epoch = 0
        self.instance = client.instance   # the server the subscription went to
        self.seq = -1            # the last message of this subscription applied
        self.renewed_at = 0.0    # when the last subscription or renewal went out
        self.acked = True        # its answer came
        self.resyncs = 0         # subscriptions sent again (lost pushes, restarts, stalls)
        self.retry_at: float | None = None
        self.backoff = RETRY_MIN_S
        self._applied = 0        # bytes applied since the last acknowledgement
        self._subscribe()

    # ---- use -------------------------------------------------------------------------
    def lacks(self, keys: list[list[bytes]], first: int) -> bool:
        """Whether the server certainly lacks chunk `first` on some rank (keys: per rank, in
        `tp_ranks` order): False whenever the copy is not trusted."""
        if not self.trusted:
            return False
        return any(k[first] not in self.keys[r] for r, k in zip(self.ranks, keys))

    def holds_all(self, keys: list[list[bytes]], first: int) -> bool:
        """Whether the copy holds every chunk from `first` on every rank (the copy is of the
        server's memory: with an L2 under it, anything short of that is asked of the server,
        whose lookup falls through to L2). False whenever the copy is not trusted."""
        if not self.trusted:
            return False
        return all(x in self.keys[r] for r, k in zip(self.ranks, keys) for x in k[first:])

    def sync(self) -> None:
        """Apply what the server sent; renew the watch when due. Never blocks."""
        if self.closed:
            return
        try:
            # ZMQ_EVENTS first: an empty recv raises zmq.Again, and that exception at every
            # engine step was most of this method's time (py-spy, vLLM's scheduler)
            while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._applied += len(frames[-1])
                self._on(P.reply_decoder.decode(frames[-1].buffer))
            self._due(self.clock())
        except zmq.ZMQError as e:   # the client was closed under us
            self.trusted, self.closed = False, True
            log.debug("key watch of %s ended: %s", self.model, e)

    def _due(self, now: float) -> None:
        if self.client.instance != self.instance and self.retry_at is None:
            return self._resync("the server restarted")
        if self.retry_at is not None:
            if now >= self.retry_at:
                self.retry_at = None
                self._subscribe()
            return
        if not self.acked:
            if now - self.renewed_at > ANSWER_S:
                self._resync("no answer within %.0f s" % ANSWER_S)
        elif self.seq >= 0 and (now - self.renewed_at > RENEW_S
                                or (not self.trusted and self._applied >= ACK_BYTES)):
            self._send(P.WatchKeys(model=self.model, tp_ranks=self.ranks, epoch=self.epoch,
                                   renew=True, seen=self.seq))
            self.renewed_at, self.acked, self._applied = now, False, 0

    def catch_up(self, timeout: float = ANSWER_S) -> bool:
        """Renew now and read until the server answers: the copy then holds every change the
        server pushed before that answer (or is untrusted). False: no answer in time. For
        a caller that must know the copy is as new as something it just learned from the
        server (a lookup), not for the connector's hot path."""
        end = self.clock() + timeout
        sent = False
        while self.clock() < end and not self.closed:
            self.sync()
            if not self.trusted or self.retry_at is not None:
                return True
            if self.acked:
                if sent:
                    return True
                self._send(P.WatchKeys(model=self.model, tp_ranks=self.ranks,
                                       epoch=self.epoch, renew=True, seen=self.seq))
                self.renewed_at, self.acked, self._applied = self.clock(), False, 0
                sent = True
            self.sock.poll(10)
        return False

    def close(self) -> None:
        """Stop watching: the socket closes and the server ends the watch."""
        if not self.closed:
            self.trusted, self.closed = False, True
            self.client.close_socket(self.sock)

    # ---- messages --------------------------------------------------------------------
    def _on(self, msg) -> None:
        if isinstance(msg, P.Error):   # only subscriptions can be refused
            return self._refused(msg)
        if getattr(msg, "epoch", None) != self.epoch:
            return   # an earlier subscription's
        if isinstance(msg, P.WatchAck):
            self.acked = True
            if msg.seq < 0:
                self._resync("the server does not know this watch (restarted, expired, or "
                             "dropped as it fell behind)")
            elif msg.seq != self.seq:
                # messages are sent before the ack on the same connection: another seq here
                # means some were dropped
                self._resync(f"renewal says message {msg.seq}, {self.seq} arrived")
            return
        if msg.seq != self.seq + 1:
            return self._resync(f"message {msg.seq} after {self.seq}: some were lost")
        self.seq = msg.seq
        if isinstance(msg, P.KeySnapshot):
            if msg.seq == 0:   # the first part: the subscription is answered
                self.keys = {r: set() for r in self.ranks}
                self.acked, self.refused, self.backoff = True, None, RETRY_MIN_S
                self.renewed_at = self.clock()
            for r, ks in msg.keys.items():
                if r in self.keys:
                    self.keys[r].update(ks)
            if not msg.more:
                self.trusted = True
                if self.listener is not None:
                    self.listener.keys_resynced(self.keys)
        elif isinstance(msg, P.KeyEvents):
            for r, ks in msg.added.items():
                if r in self.keys:
                    self.keys[r].update(ks)
            for r, ks in msg.removed.items():
                if r in self.keys:
                    self.keys[r].difference_update(ks)
            if self.trusted and self.listener is not None:
                self.listener.keys_changed(msg.added, msg.removed)

    def _refused(self, err: P.Error) -> None:
        self.trusted, self.acked = False, True
        if self.refused != err.code:
            log.info("kvedit: the server refused a key watch of %s (%s): %s; lookups ask it, "
                     "and the watch is tried again in %.0f s", self.model, err.code,
                     err.message, self.backoff)
        self.refused = err.code
        # jitter: many connectors refused at once do not all come back at once
        self.retry_at = self.clock() + self.backoff * random.uniform(0.8, 1.2)
        self.backoff = min(RETRY_MAX_S, 2 * self.backoff)

    def _resync(self, why: str) -> None:
        log.debug("kvedit key watch of %s: subscribing again (%s)", self.model, why)
        self.resyncs += 1
        if not self.acked and self.client.reload_secret() or \
                self._credentials != self.client.credentials:
            # the server may have restarted with another secret: a socket made with it
            self.client.close_socket(self.sock)
            self.sock = self.client.open_socket(rcvhwm=RCV_HWM)
            self._credentials = self.client.credentials
        self._subscribe()

    def _subscribe(self) -> None:
        seen, self.seq = self.seq, -1
        self.instance = self.client.instance
        self.epoch += 1
        self.trusted, self.acked, self._applied = False, False, 0
        self.renewed_at = self.clock()
        # `seen`: what arrived of the last subscription, so the server counts it as read
        self._send(P.WatchKeys(model=self.model, tp_ranks=self.ranks, epoch=self.epoch,
                               seen=seen))

    def _send(self, msg) -> None:
        try:
            self.sock.send_multipart([b"watch", P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:   # not connected yet: unanswered, so sent again after ANSWER_S
            self.trusted = False
