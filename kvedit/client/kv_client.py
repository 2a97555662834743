"""KVClient: the low-level client of the kvedit server, used by the SDK and the vLLM connector.

Control messages go over ZMQ (one DEALER socket per thread, so a server-side wait in one
thread never holds up another). Chunk bytes move through one transport chosen at connect
(kvedit.client.transport): the server's shared-memory segment when this process can map it, else
the server's data link (raw TCP, kvedit.client.datalink).

Sessions and authentication: each client draws a random 16-byte session id; every DEALER
socket's ZMQ routing id is that session plus a 4-byte socket number, and the data link
announces the session in its handshake, so the server binds the stores and leases it hands
out to this client (another client's Commit/Release/PUT/GET of them gets `not_holder`).
With a shared secret (argument, $KVEDIT_SECRET or $KVEDIT_SECRET_FILE, see kvedit.auth)
every ZMQ socket is a CURVE client (which checks the server's key before it sends anything
of its own) and the data-link handshake has the server prove the secret before the client
answers with its HMAC. A secret that lives in a file (the argument, the environment, or a
loopback server's own file in the runtime directory) is read again when the server stops
answering: a server restarted with another secret is found again (`reload_secret`).
The first request is a Hello naming this client's protocol version; a server of another
one answers with an error naming both (KVError "protocol") instead of a message this
client could not decode.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time

import numpy as np
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvedit import auth
from kvedit import protocol as P
from kvedit.client.datalink import LinkClient, client_idle_timeout
from kvedit.client.handles import (KVError, Retrieved, ServerUnavailable, StoreHandle, StoreResult,
                            ttl_margin)
from kvedit.client.key_watch import KeyListener, KeyWatch
from kvedit.layout import ModelLayout
from kvedit.protocol import ServerInfo
from kvedit.client.transport import ShmTransport, SocketTransport, Transport

__all__ = ["KVClient"]
log = logging.getLogger("kvedit.client")
# Errors that mean "this id is gone, nothing left to undo" when aborting a store.
_ABORT_GONE = frozenset({"unknown_store", "store_expired", "busy"})


class KVClient:
    """Client of one kvedit server. Thread-safe: each thread gets its own ZMQ socket and data
    connection, so a server-side wait (lookup with wait_timeout) holds up only its caller.

    `transfer_mode` ("shm" or "socket", read-only) says which transport connect chose. With
    shared memory, store copies into slots of the mapped segment and retrieve returns
    zero-copy views into it, valid until release(); over the socket the bytes travel on the
    data link and retrieved tensors live in receive buffers reused after release().
    Survives a server restart: the next reply with a new instance id re-attaches, and models
    registered through this client are registered again on demand. Over the socket,
    `data_idle_timeout` (default: half the server's --data-idle-timeout) is how long an idle
    data connection is reused; one the server closed is replaced before use, and a transfer
    that found it closed is sent again once (kvedit.client.datalink; `counters()`).
    With no secret given (nor $KVEDIT_SECRET / $KVEDIT_SECRET_FILE), a loopback server's own
    secret is read from this user's runtime directory (kvedit.rundir).
    """

    def __init__(self, url: str = "tcp://127.0.0.1:6555", *, use_shm: bool | None = None,
                 timeout: float = 30.0, secret: str | bytes | auth.SecretSource | None = None,
                 secret_file: str | None = None, data_idle_timeout: float | None = None):
        """`secret`: the secret, or an auth.SecretSource (read now and again on reconnects)."""
        self.url, self.timeout, self._use_shm = url, timeout, use_shm
        self._data_idle_timeout = data_idle_timeout
        self._source = (secret if isinstance(secret, auth.SecretSource)
                        else auth.SecretSource(secret, secret_file, url=url))
        self._secret = self._source.read()
        self.credentials = 0      # bumped when the secret changes: sockets are made anew
        self.session = secrets.token_bytes(auth.SESSION_BYTES)
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._socket_no = itertools.count()
        self._transport: Transport | None = None
        self._info: ServerInfo | None = None
        self._lock = threading.RLock()  # _check_instance reconnects while holding it
        self._rids = itertools.count(1)
        self._registered: dict[tuple[str, int], ModelLayout] = {}
        self._closed = False
        try:
            self._connect()
        except BaseException:
            self.close()  # an open ZMQ socket would block interpreter exit
            raise

    # ---- connection -------------------------------------------------------------------
    def _hello(self) -> ServerInfo:
        try:
            return self._call(P.Hello(protocol=P.PROTOCOL))
        except KVError as e:
            # a server from before versions refuses the field it does not know
            if e.code == "malformed" and "protocol" in e.message:
                raise KVError("protocol", f"the kvedit server at {self.url} speaks an older "
                                          f"protocol (1, before versions) and this client "
                                          f"speaks {P.PROTOCOL}: run the client and the "
                                          f"server from the same kvedit release") from None
            raise

    def _connect(self) -> None:
        """(Re)read ServerInfo and choose the transport as use_shm asks."""
        info = self._hello()
        old, self._transport = self._transport, None
        if old is not None:
            old.close()
        self._info = info
        shm = ShmTransport.attach(info) if self._use_shm is not False else "use_shm=False"
        if isinstance(shm, ShmTransport):
            self._transport = shm
            return
        if self._use_shm:
            raise KVError("shm_unavailable", f"use_shm=True but {shm}")
        if self._use_shm is None and info.shm_name:
            log.info("kvedit client: socket transfers (%s)", shm)
        host = self.url.rsplit("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        idle = client_idle_timeout(info.data_idle_timeout, self._data_idle_timeout)
        self._transport = SocketTransport(LinkClient(host, info.data_port, self.timeout,
                                                     self.session, self._secret, idle))

    def _check_instance(self, instance: int) -> None:
        """A reply from a restarted server: re-attach before trusting its slot offsets."""
        if instance != self._info.instance:
            with self._lock:
                if instance != self._info.instance:
                    log.warning("kvedit server at %s restarted: re-attaching", self.url)
                    self._connect()

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is not None and self._local.credentials != self.credentials:
            self._drop_sock()   # made with a secret that changed since
            s = None
        if s is None:
            if self._closed:
                raise KVError("closed", "KVClient is closed")
            s = self._local.sock = self.open_socket()
            self._local.credentials = self.credentials
            # the connection's end, seen at once: a request sent just before a server stopped
            # is never answered, and waiting for it blocked the next call for a whole timeout
            mon = self._local.mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            with self._lock:
                self._sockets.append(mon)
            self._local.poller = zmq.Poller()
            self._local.poller.register(s, zmq.POLLIN)
            self._local.poller.register(mon, zmq.POLLIN)
        return s

    def open_socket(self, rcvhwm: int | None = None) -> zmq.Socket:
        """A DEALER socket to the server with this client's session and current secret,
        closed with this client (or by `close_socket`)."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            s.setsockopt(zmq.RCVHWM, rcvhwm)
        # session + socket number: unique per socket, and the server's holder is the session
        s.setsockopt(zmq.ROUTING_ID, self.session + next(self._socket_no).to_bytes(4, "big"))
        if self._secret is not None:
            auth.curve_client(s, self._secret)
        s.connect(self.url)
        with self._lock:
            self._sockets.append(s)
        return s

    def close_socket(self, s: zmq.Socket) -> None:
        with self._lock:
            if s in self._sockets:
                self._sockets.remove(s)
        s.close(linger=0)

    def reload_secret(self) -> bool:
        """Read the secret again where it came from (a file, or a loopback server's own file):
        True when it changed, and sockets are then made anew with it (the data link's with
        the next re-attach). A server restarted with another secret never answers sockets
        made with the old one (CURVE)."""
        if not self._source.rereads:
            return False
        try:
            new = self._source.read()
        except auth.AuthError as e:
            log.warning("kvedit client: cannot read the secret again: %s", e)
            return False
        if new == self._secret:
            return False
        log.warning("kvedit server at %s: the secret changed (a restarted server made a new "
                    "one?): reconnecting with it", self.url)
        with self._lock:
            self._secret = new
            self.credentials += 1
        return True

    def watch_keys(self, model: str, tp_ranks: list[int],
                   listener: KeyListener | None = None) -> KeyWatch:
        """A copy of which "kv" keys of `model` the server holds ready, kept current by the
        server's pushes (kvedit.client.key_watch): call its `sync()` from one thread;
        `listener` hears what it learns there."""
        return KeyWatch(self, model, tp_ranks, listener=listener)

    def _drop_sock(self) -> None:
        """After a timeout: a fresh socket, so queued requests are never replayed later."""
        s, mon = self._local.sock, self._local.mon
        self._local.sock = self._local.mon = self._local.poller = None
        self.close_socket(mon)
        self.close_socket(s)

    def _limits(self, msg) -> None:
        """Refuse what the server would refuse anyway, with a clear error instead of a
        dropped message (libzmq drops a message over MAXMSGSIZE without a reply)."""
        keys = getattr(msg, "keys", None)
        cap = self._info.max_keys_per_request if self._info is not None else 0
        if keys is not None and cap and len(keys) > cap:
            raise KVError("too_many_keys", f"{type(msg).__name__} with {len(keys)} keys; the "
                                           f"server takes at most {cap} per request: split it")

    def _call(self, msg, timeout: float | None = None):
        """Send one request and wait for its reply. Raises KVError."""
        if self._closed:
            raise KVError("closed", "KVClient is closed")
        self._limits(msg)
        body = P.encoder.encode(msg)
        cap = self._info.max_message_bytes if self._info is not None else 0
        if cap and len(body) > cap:
            raise KVError("too_large", f"{type(msg).__name__} is {len(body)} bytes; the server "
                                       f"takes messages of at most {cap} bytes: split it")
        sock = self._sock()
        mon, poller = self._local.mon, self._local.poller
        _disconnected(mon)   # an end before this request is not about it
        rid = next(self._rids).to_bytes(8, "little")
        sock.send_multipart([rid, body])
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
            if sock not in events and mon in events and _disconnected(mon):
                self._drop_sock()
                if self.reload_secret():
                    return self._call(msg, timeout)
                raise ServerUnavailable("timeout", f"the connection to the kvedit server at "
                                                   f"{self.url} closed before it answered "
                                                   f"{type(msg).__name__} (it stopped or "
                                                   f"restarted; the request may or may not "
                                                   f"have been carried out)")
            if sock not in events and not (mon in events and left > 0):
                self._drop_sock()
                if self.reload_secret():   # a restarted server with another secret
                    return self._call(msg, timeout)
                hint = (" (with a secret set, a server with another secret or none never "
                        "answers: CURVE drops the connection)" if self._secret else
                        " (no secret found: a server with one, the default, never answers; "
                        "give secret_file=, $KVEDIT_SECRET_FILE, or run as the server's user "
                        "for a loopback server's own file, kvedit.rundir)")
                raise ServerUnavailable("timeout", f"no reply from the kvedit server at "
                                                   f"{self.url} within {timeout or self.timeout}"
                                                   f" s to {type(msg).__name__}{hint}")
            if sock not in events:
                continue
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == rid:  # else: the late reply of an earlier, timed-out call
                break
        reply = P.reply_decoder.decode(frames[1].buffer)
        if isinstance(reply, P.Error):
            raise KVError(reply.code, reply.message)
        return reply

    def _model_call(self, model: str, tp_rank: int, msg, timeout: float | None = None):
        """A call naming a model: re-register once if a restarted server forgot it."""
        try:
            return self._call(msg, timeout=timeout)
        except KVError as e:
            layout = self._registered.get((model, tp_rank))
            if e.code != "unknown_model" or layout is None:
                raise
        self._call(P.Register(model=model, layout=layout))
        return self._call(msg, timeout=timeout)

    @property
    def transfer_mode(self) -> str:
        """"shm" or "socket": which transport connect chose (for reports; callers never
        need to switch on it)."""
        return self._transport.mode if self._transport is not None else "closed"

    @property
    def instance(self) -> int:
        """The instance id of the server last heard from (a new one: it restarted)."""
        return self._info.instance if self._info is not None else 0

    @property
    def max_keys(self) -> int:
        """Most keys the server takes in one request (0: no limit known)."""
        return self._info.max_keys_per_request if self._info is not None else 0

    def segment(self) -> tuple[str, torch.Tensor] | None:
        """(path, bytes) of the attached shared-memory segment, None over the socket.

        Retrieved views point into these bytes, so `view.data_ptr() - bytes.data_ptr()` is the
        chunk's offset in the file at `path` (what kvedit.sdk.chunkmap maps from). Ask again
        after each retrieve: a server restart re-attaches a new segment."""
        t = self._transport
        return None if t is None else t.segment()

    # ---- what StoreHandle and Retrieved call ------------------------------------------
    def commit_store(self, store_id: int) -> int:
        """Commit a prepared store; returns the number of chunks it made ready."""
        return self._call(P.Commit(store_id=store_id)).stored

    def abort_store(self, store_id: int) -> None:
        """Abort a prepared store; a store already gone (expired, committed) is not an error."""
        try:
            self._call(P.Abort(store_id=store_id))
        except KVError as e:
            # gone already (TTL; the late abort acknowledges it), or a broken data-link PUT
            # still winding down on an older server: the write TTL reclaims the slots
            if e.code not in _ABORT_GONE:
                raise

    def release_lease(self, lease_id: int) -> None:
        """Release a read lease; KVError("lease_expired") if it ran out before."""
        self._call(P.Release(lease_id=lease_id))

    # ---- API --------------------------------------------------------------------------
    def server_info(self) -> ServerInfo:
        return self._hello()

    def register(self, model: str, layout: ModelLayout) -> None:
        self._call(P.Register(model=model, layout=layout))
        self._registered[(model, layout.tp_rank)] = layout

    def get_layout(self, model: str, tp_rank: int = 0) -> ModelLayout | None:
        return self._call(P.GetLayout(model=model, tp_rank=tp_rank)).layout

    def list_models(self) -> dict[str, list[ModelLayout]]:
        return self._call(P.ListModels()).models

    def lookup(self, model: str, keys: list[bytes], wait_timeout: float = 0.0,
               tp_rank: int = 0, kind: P.ObjectKind = "kv") -> int:
        """How many leading keys are ready (kind "queries": captured-queries objects); with
        wait_timeout > 0 the server answers once all are, or when the time passes."""
        msg = P.Lookup(model=model, keys=list(keys), tp_rank=tp_rank,
                       wait_timeout=float(wait_timeout), kind=kind)
        return self._model_call(model, tp_rank, msg, self.timeout + max(0.0, wait_timeout)).n

    def prepare_store(self, model: str, keys: list[bytes], tp_rank: int = 0) -> StoreHandle:
        msg = P.PrepareStore(model=model, keys=list(keys), tp_rank=tp_rank)
        t0 = time.monotonic()  # the server's write TTL starts later: a conservative deadline
        slots = self._model_call(model, tp_rank, msg)
        self._check_instance(slots.instance)
        ttl = self._info.write_ttl
        return StoreHandle(self, self._transport, slots, t0 + ttl - ttl_margin(ttl))

    def store(self, model: str, keys: list[bytes], chunks, tp_rank: int = 0) -> StoreResult:
        if isinstance(chunks, torch.Tensor) and chunks.dim() == 5:
            chunks = list(chunks.unbind(0))
        chunks = list(chunks)
        if len(chunks) != len(keys):
            raise KVError("bad_chunk", f"{len(chunks)} chunk(s) for {len(keys)} key(s), "
                                       f"expected one chunk per key")
        handle = self.prepare_store(model, keys, tp_rank)
        lay = handle.layout
        dtype = getattr(torch, lay.dtype)
        for i, c in enumerate(chunks):
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != lay.chunk_shape \
                    or c.dtype != dtype:
                handle.abort()
                got = (f"{tuple(c.shape)} {c.dtype}" if isinstance(c, torch.Tensor)
                       else type(c).__name__)
                raise KVError("bad_chunk", f"chunk {i} is {got}, expected a tensor "
                                           f"{lay.chunk_shape} {dtype} (model {model!r} layout)")
        return handle.commit([chunks[i] for i in handle.missing])

    def retrieve(self, model: str, keys: list[bytes], tp_rank: int = 0) -> Retrieved:
        return self._retrieve(model, keys, tp_rank, "kv")

    def _retrieve(self, model: str, keys: list[bytes], tp_rank: int,
                  kind: P.ObjectKind) -> Retrieved:
        transport = self._transport
        if transport.with_data and len(set(keys)) < len(keys):   # a GET sends a chunk once
            first = list(dict.fromkeys(keys))
            return self._retrieve(model, first, tp_rank, kind).spread(first, list(keys))
        msg = P.Retrieve(model=model, keys=list(keys), tp_rank=tp_rank,
                         with_data=transport.with_data, kind=kind)
        t0 = time.monotonic()  # the server's lease TTL starts later: a conservative deadline
        reply = self._model_call(model, tp_rank, msg)
        self._check_instance(reply.instance)  # a restarted server: new segment and data port
        current = self._transport
        if current.with_data != transport.with_data:  # re-attached the other way: ask again
            try:
                self.release_lease(reply.lease_id)
            except KVError as e:  # an empty with_data lease may not exist: nothing to release
                if e.code not in ("unknown_lease", "lease_expired"):
                    raise
            return self._retrieve(model, keys, tp_rank, kind)
        ttl = self._info.lease_ttl
        return current.open_lease(self, reply, t0 + ttl - ttl_margin(ttl))

    def pin(self, model: str, keys: list[bytes], tp_rank: int = 0) -> tuple[int, int]:
        """Lease the leading ready `keys` without reading them -> (lease id, how many): the
        server keeps them (no eviction) until `unpin(lease id)` or its lease TTL. What the
        connector's lookup holds until the load (kvedit.vllm.transfer.pins)."""
        reply = self._model_call(model, tp_rank, P.Retrieve(model=model, keys=list(keys),
                                                            tp_rank=tp_rank))
        return reply.lease_id, reply.count

    def unpin(self, lease_id: int) -> None:
        """Let go of a pin; one already gone (expired, a restarted server) is not an error."""
        try:
            self.release_lease(lease_id)
        except KVError as e:
            if e.code not in ("unknown_lease", "lease_expired", "not_holder"):
                raise

    def delete(self, model: str, keys: list[bytes], tp_rank: int = 0) -> int:
        return self._model_call(model, tp_rank,
                                P.Delete(model=model, keys=list(keys), tp_rank=tp_rank)).n

    def stats(self) -> dict:
        """The server's counters (Stats); this client's own are `counters()`."""
        return self._call(P.Stats()).stats

    def counters(self) -> dict[str, int]:
        """This client's own counters: data-link connections opened, idle ones replaced
        before use (`idle_reconnects`), ones found closed by the server before use
        (`closed_reconnects`) and transfers sent again after such a close (`retries`);
        zeros over shared memory."""
        out = {"connects": 0, "idle_reconnects": 0, "closed_reconnects": 0, "retries": 0}
        return out | (self._transport.counters() if self._transport is not None else {})

    # ---- captured queries: one object of kind "queries" per key -------------
    def store_queries(self, model: str, key: bytes, data: torch.Tensor,
                      tp_rank: int = 0) -> None:
        """Store `data`'s bytes (any shape and dtype; made contiguous) under `key`, replacing
        an object already there. The server bounds the size (--max-query-bytes: too_large).
        (model, tp_rank) must be registered. Raises KVError."""
        if not isinstance(data, torch.Tensor) or data.numel() == 0:
            got = (f"an empty tensor {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                   else type(data).__name__)
            raise KVError("bad_chunk", f"store_queries needs a non-empty tensor, got {got}")
        raw = data.detach().contiguous().view(-1).view(torch.uint8)
        msg = P.PrepareStore(model=model, keys=[key], tp_rank=tp_rank, kind="queries",
                             nbytes=raw.numel())
        t0 = time.monotonic()
        slots = self._model_call(model, tp_rank, msg)
        self._check_instance(slots.instance)
        ttl = self._info.write_ttl
        handle = StoreHandle(self, self._transport, slots, t0 + ttl - ttl_margin(ttl))
        # nothing missing: another store of this key is writing it right now (same bytes:
        # the same prompt and window); committing the empty store just closes it
        handle.commit([raw] if handle.missing else None)

    def fetch_queries(self, model: str, key: bytes, tp_rank: int = 0) -> np.ndarray | None:
        """A copy of the queries object under `key` as a flat uint8 array; None when there is
        none (never stored, evicted, deleted). Raises KVError (lease_expired: retry)."""
        with self._retrieve(model, [key], tp_rank, "queries") as got:
            if not len(got):
                return None
            got.check_lease()
            out = got.tensors[0].numpy().copy()
        return out   # leaving `with` released the lease; lease_expired raised from there

    def delete_queries(self, model: str, keys: list[bytes], tp_rank: int = 0) -> int:
        """Delete queries objects -> how many were there (a leased one is hidden now and
        freed at its release)."""
        msg = P.Delete(model=model, keys=list(keys), tp_rank=tp_rank, kind="queries")
        return self._model_call(model, tp_rank, msg).n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for s in self._sockets:
                s.close(linger=0)
            self._sockets.clear()
        if self._transport is not None:
            self._transport.close()
        self._ctx.term()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _disconnected(mon: zmq.Socket) -> bool:
    """Drain a socket monitor's events -> whether one was a disconnection."""
    seen = False
    while True:
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return seen
        seen |= parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED
