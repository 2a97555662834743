"""The HTTP API: health, status, config, Prometheus metrics, cache listing and deletion.

starlette routes served by uvicorn on its own event loop in one thread of the server
process (the stdlib http.server it replaces wrote headers and body in separate segments, so
every keep-alive request waited for a delayed ACK, and logged a BrokenPipe traceback
for each client that left early). Routes read the service only through http_state's
narrow functions; the ones that take the service lock run in the worker thread pool, so a
long control-loop request never stalls the event loop (and /health with it).
Connections are bounded per peer and in all, heads have a deadline, and /health is answered
however many connections others hold (_Gate, _Protocol below; docs/http.md).
The socket is bound in the constructor, so a busy port fails `kvedit server` at start.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvedit import __version__
from kvedit.auth import (AUTH_HEADER, CHALLENGE_HEADER, ENDPOINT_HEADER, HTTP_AUTH, PROOF_HEADER,
                         endpoint, http_authorized, http_proof, sent_raw_secret)
from kvedit.server import http_state as state
from kvedit.server.http_openapi import MAX_CURSOR, MAX_MODEL_PARAM, MAX_PAGE, SPEC
from kvedit.server.config import listen_backlog
from kvedit.server.http_accept import ScreeningSocket, bind
from kvedit.server.http_peer import PeerKey, peer_key
from kvedit.server.service import Service

log = logging.getLogger("kvedit.server")
ENDPOINTS = "/health /status /config /metrics /cache (GET, DELETE) /openapi.json"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KEEP_ALIVE_S = 5             # an idle keep-alive connection is closed after this
MAX_HEAD_BYTES = 64 << 10    # a request head larger than this is refused (431) and closed
# the connection bounds and the head timeout are ServerConfig's http_* settings


def _json(body, status: int = 200, headers: dict | None = None) -> Response:
    return Response((json.dumps(body, indent=1) + "\n").encode(), status,
                    headers=headers, media_type="application/json")


def _error(status: int, message: str, headers: dict | None = None) -> Response:
    return _json({"error": message}, status, headers)


class _BadParam(ValueError):
    pass


def _param(req: Request, name: str, max_chars: int) -> str | None:
    vals = req.query_params.getlist(name)
    if not vals:
        return None
    v = vals[-1]  # the last one wins, as with the stdlib server
    if not 1 <= len(v) <= max_chars:
        raise _BadParam(f"query parameter {name!r} must be 1..{max_chars} characters, "
                        f"got {len(v)}")
    return v


def _limit(req: Request) -> int:
    raw = _param(req, "limit", 8) or "100"
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise _BadParam(f"limit must be an integer 1..{MAX_PAGE}, got {raw!r}")
    return limit


def _after(req: Request) -> int | None:
    if "offset" in req.query_params:
        raise _BadParam("offset is gone: pass the previous page's next_after as ?after=")
    raw = _param(req, "after", MAX_CURSOR)
    if raw is None:
        return None
    try:
        after = int(raw)
    except ValueError:
        after = -1
    if not 0 <= after < 2**63:
        raise _BadParam(f"after must be the next_after of a previous page (an integer >= 0), "
                        f"got {raw!r}")
    return after


class _Routes:
    """The endpoints. Those behind the secret run in worker threads (`guarded`): the service
    lock they take for an O(1)/O(page) read may be held by a long control request."""

    def __init__(self, service: Service, secret: bytes | None):
        self.service, self.secret = service, secret

    def app(self) -> Starlette:
        g = self.guarded
        routes = [Route("/health", self.health), Route("/metrics", self.metrics),
                  Route("/openapi.json", self.openapi),
                  Route("/status", g(self.status)), Route("/config", g(self.config)),
                  Route("/cache", g(self.cache), methods=["GET", "DELETE"])]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self.http_error})
        app.router.redirect_slashes = False  # /status/ is a JSON 404, not a bodiless redirect
        return app

    def guarded(self, fn):
        """The endpoint needs `Authorization: Bearer <secret>` when the server has one."""
        async def endpoint(req: Request) -> Response:
            header = req.headers.get("authorization")
            if not http_authorized(header, self.secret):
                return _error(401, _unauthorized(req.url.path, sent_raw_secret(header,
                                                                               self.secret)),
                              {"WWW-Authenticate": 'Bearer realm="kvedit"'})
            if req.method == "DELETE" and await req.is_disconnected():
                return _error(499, "the client went away before its request was run")
            try:
                return await asyncio.to_thread(fn, req)
            except _BadParam as e:
                return _error(400, str(e))
            except state.UnknownModel as e:
                names = state.model_names(self.service)
                more = f" and {len(names) - 20} more" if len(names) > 20 else ""
                return _error(404, f"model {e.args[0]!r} is not registered; registered: "
                                   f"{names[:20]}{more}")
        return endpoint

    async def health(self, req: Request) -> Response:
        # a client that has the secret asks the server to prove it has it too, on the
        # endpoint the client connected to, before it sends a bearer token (auth.http_proof):
        # a process squatting a port cannot, nor can it relay the proof of another server
        where = endpoint(req.scope.get("server") or ("", 0))
        proof = http_proof(self.secret, req.headers.get(CHALLENGE_HEADER), where)
        headers = {AUTH_HEADER: str(HTTP_AUTH)}
        if proof:
            headers |= {PROOF_HEADER: proof, ENDPOINT_HEADER: where}
        return _json({"status": "ok", "instance": self.service.instance}, headers=headers)

    async def metrics(self, _req: Request) -> Response:
        body = await asyncio.to_thread(state.metrics, self.service)
        return Response(body, 200, media_type=METRICS_TYPE)

    async def openapi(self, _req: Request) -> Response:
        return _json(SPEC)

    def status(self, _req: Request) -> Response:
        return _json(state.status(self.service))

    def config(self, _req: Request) -> Response:
        return _json(state.config(self.service))

    def cache(self, req: Request) -> Response:
        model = _param(req, "model", MAX_MODEL_PARAM)
        if req.method == "DELETE":
            return _json({"deleted": state.clear(self.service, model), "model": model})
        limit, after = _limit(req), _after(req)
        p = state.page(self.service, model, after, limit)
        return _json({"total": p.total, "limit": limit, "after": after,
                      "next_after": p.next_after,
                      "items": [{f: getattr(i, f) for f in i.__slots__} for i in p.items]})

    async def http_error(self, req: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return _error(404, f"no endpoint {req.url.path}; endpoints: {ENDPOINTS}")
        if exc.status_code == 405:
            return _error(405, f"{req.method} is not allowed on {req.url.path}; endpoints: "
                               f"{ENDPOINTS}", dict(exc.headers or {}))
        return _error(exc.status_code, str(exc.detail), dict(exc.headers or {}))


def _unauthorized(path: str, raw_secret: bool) -> str:
    if raw_secret:   # a client from before HTTP auth 2 sent the secret itself
        return (f"{path}: the bearer token is the kvedit secret itself, which this server "
                f"(kvedit {__version__}, HTTP auth {HTTP_AUTH}) never takes over HTTP: a "
                f"client from before HTTP auth {HTTP_AUTH} sent it (treat the secret as seen "
                f"by whoever could read this connection). Send the token derived from it "
                f"for HTTP: `kvedit http-token --secret-file PATH`, kvedit.auth.http_token, "
                f"or a kvedit client of this release")
    return (f"{path} needs the header 'Authorization: Bearer <token>', the HTTP token derived "
            f"from the server's secret: `kvedit http-token --secret-file PATH` (or --port "
            f"for a secret the server made), kvedit.auth.bearer_header")


def build_app(service: Service, secret: bytes | None) -> Starlette:
    return _Routes(service, secret).app()


class _Gate:
    """The open connections of one HTTP server, and who may take another (event-loop thread
    only). Bounds: `max_conns` in all, `per_peer` per peer (http_peer.py: a local user by
    uid, else an address). A new connection over a bound closes the oldest *idle* one of that
    peer (or of all): one with no request being served, i.e. a head not yet complete or a
    keep-alive between requests. So connections held open without a request cannot lock
    anyone out, whoever holds them; only when every connection has a request in flight is the
    newcomer refused (503, closed). The server's own user (who can read its secret anyway)
    is never refused: its liveness probe is answered whatever others hold."""

    def __init__(self, max_conns: int, per_peer: int, own_uid: int | None = None):
        self.max_conns, self.per_peer = max_conns, per_peer
        self.own: PeerKey = ("uid", os.getuid() if own_uid is None else own_uid)
        self.open: dict[_Protocol, PeerKey] = {}     # in the order they opened
        self.count: dict[PeerKey, int] = {}

    def admit(self, conn: _Protocol, peer: PeerKey) -> bool:
        mine = peer == self.own
        if self.count.get(peer, 0) >= self.per_peer and not self._evict(peer) and not mine:
            return False
        if len(self.open) >= self.max_conns and not self._evict(None) and not mine:
            return False
        self.open[conn] = peer
        self.count[peer] = self.count.get(peer, 0) + 1
        return True

    def leave(self, conn: _Protocol) -> None:
        peer = self.open.pop(conn, None)
        if peer is not None:
            self.count[peer] -= 1
            if not self.count[peer]:
                del self.count[peer]

    def _evict(self, peer: PeerKey | None) -> bool:
        for conn, p in self.open.items():
            if (peer is None or p == peer) and conn.idle():
                self.leave(conn)
                conn.transport.close()
                return True
        return False


class _Protocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol plus: the connection bounds (_Gate), a deadline on request
    heads, requests in flight bounded except /health and authorized ones, and answers to a
    client that half-closes after its request.

    uvicorn waits forever for the first bytes of a connection and for a head that stops
    half-way, and its connection cap answers 503 to everyone, /health included, once
    anybody holds that many connections. Here a connection with no request in flight is
    closed `head_timeout` after it opened or after its last response, /health and requests
    carrying the bearer token are always served, and the others get 503 only while
    `max_requests` are being served. A client that shuts down its sending side after a
    request (EOF) still gets the answer: asyncio would close the transport on EOF, and a
    thread-backed endpoint's answer (DELETE /cache done!) would go nowhere."""

    gate: _Gate
    listener: ScreeningSocket
    secret: bytes | None
    head_timeout: float
    max_requests: int

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._heads = self._done = self._head_bytes = 0
        self._timer = None
        self._eof = False
        sock, there = transport.get_extra_info("socket"), transport.get_extra_info("peername")
        peer = self.listener.take_key(sock.fileno(), there) if sock is not None else None
        if peer is None:
            peer = peer_key(transport.get_extra_info("sockname"), there)
        if not self.gate.admit(self, peer):
            transport.write(_BUSY)
            transport.close()
            return
        self._arm()

    def idle(self) -> bool:
        return self._heads == self._done and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        # httptools sets no limit on a request head: bound the bytes we buffer for one
        if self._heads == self._done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                body = b'{"error": "request head over %d bytes"}\n' % MAX_HEAD_BYTES
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                     b"Content-Type: application/json\r\nConnection: close\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                self.transport.close()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._heads += 1
        # uvicorn answers 503 when connections or tasks reach limit_concurrency: 0 makes it
        # answer 503 now, None serves the request
        busy = len(self.tasks) >= self.max_requests and not self._exempt()
        self.limit_concurrency = 0 if busy else None
        super().on_headers_complete()

    def _exempt(self) -> bool:
        if self.url.split(b"?", 1)[0] == b"/health":
            return True
        auth = next((v for k, v in self.headers if k == b"authorization"), None)
        return self.secret is not None and http_authorized(
            auth.decode("latin-1") if auth is not None else None, self.secret)

    def eof_received(self) -> bool:
        self._eof = True
        return self._heads > self._done   # True: keep the transport to send the answer

    def on_response_complete(self) -> None:
        self._done += 1
        self._head_bytes = 0
        super().on_response_complete()
        if self._eof and self._heads == self._done:
            self.transport.close()   # the client sends nothing more
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self.gate.leave(self)
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.head_timeout, self._deadline, self._done)

    def _deadline(self, done_when_armed: int) -> None:
        self._timer = None
        if self._heads > self._done:   # a request is being served: not ours to cut
            return
        if self._done == done_when_armed and not self.transport.is_closing():
            self.transport.close()


_BUSY_BODY = b'{"error": "too many open HTTP connections, each with a request in flight"}\n'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def protocol_class(listener: ScreeningSocket, secret: bytes | None, *, max_conns: int,
                   per_peer: int, head_timeout: float, max_requests: int) -> type[_Protocol]:
    """The protocol uvicorn instantiates per connection, bound to one server's gate."""
    return type("KveditHttp", (_Protocol,), {
        "gate": _Gate(max_conns, per_peer), "listener": listener, "secret": secret,
        "head_timeout": head_timeout, "max_requests": max_requests})


class HttpApi:
    """start() runs uvicorn in a thread; close() stops it and waits for the thread."""

    def __init__(self, service: Service, host: str, port: int, secret: bytes | None = None):
        c = service.cfg
        self.sock = bind(host, port, c.http_new_conns_per_peer)
        proto = protocol_class(self.sock, secret, max_conns=c.http_max_conns,
                               per_peer=c.http_max_conns_per_peer,
                               head_timeout=c.http_head_timeout,
                               max_requests=c.http_max_requests)
        # log_level "error": a peer's malformed request is its problem, not a server log line
        # asyncio listens again with uvicorn's backlog and accepts up to that many per wakeup
        # (until EAGAIN): the kernel's cap for both
        cfg = uvicorn.Config(build_app(service, secret), log_config=None, log_level="error",
                             access_log=False, lifespan="off", loop="asyncio", http=proto,
                             backlog=listen_backlog(),
                             timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self._serve, name="kvedit-http", daemon=True)

    def _serve(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except Exception:  # the HTTP API dying must not go unseen
            log.exception("HTTP API stopped with an error")

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)
        self.sock.close()
