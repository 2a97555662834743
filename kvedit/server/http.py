"""The HTTP API: health, status, config, Prometheus metrics, cache listing and deletion.

stdlib ThreadingHTTPServer in its own threads; every read of server state takes the
service lock, so it sees the index between two ZMQ requests, never half-way through one.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kvedit.server.service import Service

MAX_PAGE = 1000


class HttpApi:
    def __init__(self, service: Service, host: str, port: int):
        handler = type("Handler", (_Handler,), {"service": service})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvedit-http",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    service: Service
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # keep the server log for the server's own events
        pass

    def _reply(self, code: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body, indent=1) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._reply(code, {"error": message})

    def do_GET(self):
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        s = self.service
        if url.path == "/health":
            return self._reply(200, {"status": "ok", "instance": s.instance})
        if url.path == "/config":
            return self._reply(200, s.cfg.to_dict())
        if url.path == "/metrics":
            with s.lock:
                body = s.metrics.render()
            return self._reply(200, body, "text/plain; version=0.0.4; charset=utf-8")
        if url.path == "/status":
            return self._reply(200, self._status())
        if url.path == "/cache":
            return self._cache_page(q)
        self._error(404, f"no endpoint {url.path}; endpoints: /health /status /config /metrics "
                         f"/cache (GET, DELETE)")

    def do_DELETE(self):
        url = urlparse(self.path)
        if url.path != "/cache":
            return self._error(404, f"no DELETE endpoint {url.path}; use DELETE /cache[?model=M]")
        model = parse_qs(url.query).get("model", [None])[-1]
        s = self.service
        with s.lock:
            if model is not None and model not in {m for m, _ in s.layouts}:
                return self._error(404, f"model {model!r} is not registered; registered: "
                                        f"{sorted({m for m, _ in s.layouts})}")
            n = s.index.clear(model)
        self._reply(200, {"deleted": n, "model": model})

    def _status(self) -> dict:
        s = self.service
        with s.lock:
            state = s.state()
            models: dict[str, list] = {}
            for (m, _), lay in sorted(s.layouts.items()):
                d = {f: getattr(lay, f) for f in lay.__struct_fields__ if f != "rope"}
                d["rope"] = None if lay.rope is None else {
                    f: getattr(lay.rope, f) for f in lay.rope.__struct_fields__}
                d["chunk_bytes"] = lay.chunk_bytes
                models.setdefault(m, []).append(d)
        return {
            "version": s.info.version, "instance": s.instance,
            "transfer_mode": state["transfer_mode"],
            "shm_name": s.cfg.shm_name, "shm_path": s.arena.path or None,
            "lazy": s.cfg.l1_use_lazy, "eviction_policy": s.cfg.eviction_policy,
            "chunk_size": s.cfg.chunk_size,
            "pool": {"bytes": state["pool_bytes"], "used": state["pool_used"],
                     "free": state["pool_free"]},
            "objects": {k: state[k] for k in ("ready", "writing", "leased")},
            "leases": state["leases"], "pending_stores": state["pending_stores"],
            "evictions": state["evictions"], "uptime_s": state["uptime_s"],
            "models": models, "notes": s.arena.notes,
        }

    def _cache_page(self, q: dict) -> None:
        try:
            offset = int(q.get("offset", 0))
            limit = int(q.get("limit", 100))
        except ValueError:
            return self._error(400, "offset and limit must be integers")
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            return self._error(400, f"expected offset >= 0 and 1 <= limit <= {MAX_PAGE}")
        model = q.get("model")
        s = self.service
        now = time.time()
        with s.lock:
            objs = [o for o in s.index.ready.values() if model is None or o.model == model]
            page = objs[offset:offset + limit]
            items = [{"key": o.key.hex(), "model": o.model, "tp_rank": o.tp_rank,
                      "bytes": o.nbytes, "age_s": round(now - o.created, 3),
                      "leases": o.leases} for o in page]
        nxt = offset + len(page)
        self._reply(200, {"total": len(objs), "offset": offset, "limit": limit,
                          "next_offset": nxt if nxt < len(objs) else None, "items": items})
