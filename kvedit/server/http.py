"""The HTTP API: health, status, config, Prometheus metrics, cache listing and deletion.

starlette routes served by uvicorn on its own event loop in one thread of the server
process (the stdlib http.server it replaces wrote headers and body in separate segments, so
every keep-alive request waited ~44 ms for a delayed ACK, and logged a BrokenPipe traceback
for each client that left early). Routes read the service only through http_state's
narrow functions; the ones that take the service lock run in the worker thread pool, so a
long control-loop request never stalls the event loop (and /health with it).
The socket is bound in the constructor, so a busy port fails `kvedit server` at start.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvedit.auth import http_authorized
from kvedit.server import http_state as state
from kvedit.server.http_openapi import MAX_CURSOR, MAX_MODEL_PARAM, MAX_PAGE, SPEC
from kvedit.server.service import Service

log = logging.getLogger("kvedit.server")
ENDPOINTS = "/health /status /config /metrics /cache (GET, DELETE) /openapi.json"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 64         # uvicorn answers 503 beyond this many open connections
KEEP_ALIVE_S = 5             # an idle keep-alive connection is closed after this
HEADER_TIMEOUT_S = 10        # ... and one that has not sent a whole request head by then
MAX_HEAD_BYTES = 64 << 10    # a request head larger than this is refused (431) and closed


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
            if not http_authorized(req.headers.get("authorization"), self.secret):
                return _error(401, f"{req.url.path} needs the header 'Authorization: Bearer "
                                   f"<secret>' (the server's --secret-file / KVEDIT_SECRET)",
                              {"WWW-Authenticate": 'Bearer realm="kvedit"'})
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

    async def health(self, _req: Request) -> Response:
        return _json({"status": "ok", "instance": self.service.instance})

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


def build_app(service: Service, secret: bytes | None) -> Starlette:
    return _Routes(service, secret).app()


class _Protocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol plus a deadline on request heads. uvicorn waits forever for
    the first bytes of a connection and for a head that stops half-way, so MAX_CONNECTIONS
    silent peers would leave everyone else with 503s. A connection with no request in
    flight is closed HEADER_TIMEOUT_S after it opened or after its last response."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._heads = self._done = self._head_bytes = 0
        self._timer = None
        self._arm()

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
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._done += 1
        self._head_bytes = 0
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(HEADER_TIMEOUT_S, self._deadline, self._done)

    def _deadline(self, done_when_armed: int) -> None:
        self._timer = None
        if self._heads > self._done:   # a request is being served: not ours to cut
            return
        if self._done == done_when_armed and not self.transport.is_closing():
            self.transport.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose proto is IPPROTO_TCP: asyncio sets TCP_NODELAY on the
    accepted connections only then (socket.create_server leaves proto 0, and uvicorn's
    separate header and body writes then meet Nagle + delayed ACK: 44 ms a request)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, kind, proto, _, addr = info[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class HttpApi:
    """start() runs uvicorn in a thread; close() stops it and waits for the thread."""

    def __init__(self, service: Service, host: str, port: int, secret: bytes | None = None):
        self.sock = _bind(host, port)
        # log_level "error": a peer's malformed request is its problem, not a server log line
        cfg = uvicorn.Config(build_app(service, secret), log_config=None, log_level="error",
                             access_log=False, lifespan="off", loop="asyncio", http=_Protocol,
                             limit_concurrency=MAX_CONNECTIONS,
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
