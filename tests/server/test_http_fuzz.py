"""Fuzz the HTTP API of a real server against its own OpenAPI description.

Requests are drawn from /openapi.json: every (path, method) it lists, with each declared
query parameter omitted, valid for its schema, just outside its bounds, or arbitrary text;
plus undeclared paths, methods, parameters and Authorization headers. Every answer must be
2xx/4xx with a JSON body (text for /metrics), never 5xx, and the server must stay up with no
traceback in its log.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvedit import auth
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key

METHODS = ["GET", "DELETE", "POST", "PUT", "PATCH", "HEAD", "OPTIONS"]
# printable ASCII without edge blanks: what an HTTP header value may carry (h11 refuses the rest)
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                      max_size=80).map(str.strip)


@pytest.fixture(scope="module", params=["no secret", "secret"])
def server(request, tmp_path_factory):
    """(server, secret or None): without a secret and with one (then 401s are in play)."""
    path = None
    if request.param == "secret":
        path = tmp_path_factory.mktemp("secret") / "secret"
        auth.generate_secret(path)
    with start_server(0.05, secret_file=path) as s, \
            KVClient(s.url, secret_file=path and str(path)) as c:
        c.register("a", SMALL)
        c.store("a", [key(i, "fz") for i in range(8)], [chunk_for(key(i, "fz")) for i in range(8)])
        yield s, path and auth.http_token(auth.load_secret(None, path))


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(server[0].http_url + "/openapi.json", timeout=10).json()


def _value(schema: dict) -> st.SearchStrategy:
    """A value valid for the schema, one just outside its bounds, or anything."""
    if schema.get("type") == "integer":
        lo, hi = schema.get("minimum", -2**31), schema.get("maximum", 2**31)
        valid = st.integers(lo, hi)
        edge = st.sampled_from([lo - 1, hi + 1, 0, -1, 2**63, 10**30])
        return st.one_of(valid, edge).map(str)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength", 100)
    return st.one_of(st.text(min_size=lo, max_size=min(hi, 64)),
                     st.just("x" * (hi + 1)), st.just(""))


def _request(spec: dict, secret: str | None) -> st.SearchStrategy:
    ops = [(path, method.upper(), op.get("parameters", []))
           for path, item in spec["paths"].items() for method, op in item.items()]

    @st.composite
    def draw(d):
        if d(st.integers(0, 9)) == 0:  # off the map: unknown path or method
            path = d(st.sampled_from(["/", "/nope", "/cache/x", "/status/", "//cache",
                                      "/%00", "/metrics?"]))
            method, declared = d(st.sampled_from(METHODS)), []
        else:
            path, method, declared = d(st.sampled_from(ops))
            if d(st.integers(0, 5)) == 0:
                method = d(st.sampled_from(METHODS))
        params: list[tuple[str, str]] = []
        for p in declared:
            for _ in range(d(st.integers(0, 2))):   # absent, once, or repeated
                params.append((p["name"], d(_value(p["schema"]))))
        for _ in range(d(st.integers(0, 2))):
            params.append((d(st.sampled_from(["offset", "limit", "model", "x", ""])),
                           d(st.text(max_size=20))))
        headers = {}
        auth_kind = d(st.sampled_from(["none", "junk", "bearer junk", "right", "right"]))
        if auth_kind == "junk":
            headers["Authorization"] = d(HEADER_TEXT)
        elif auth_kind == "bearer junk" or auth_kind == "right" and not secret:
            headers["Authorization"] = d(HEADER_TEXT.map(lambda t: ("Bearer " + t).strip()))
        elif auth_kind == "right":
            headers["Authorization"] = f"Bearer {secret}"
        if d(st.booleans()):
            headers["Accept"] = d(HEADER_TEXT)
        return method, path, params, headers
    return draw()


def test_fuzz_against_openapi(server, spec):
    server, secret = server
    client = httpx.Client(base_url=server.http_url, timeout=10)
    seen: set[int] = set()

    @settings(max_examples=400, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_request(spec, secret))
    def one(req):
        method, path, params, headers = req
        r = client.request(method, path, params=params, headers=headers)
        seen.add(r.status_code)
        assert 200 <= r.status_code < 500, (req, r.status_code, r.text[:300])
        op = spec["paths"].get(r.url.path, {}).get(method.lower())
        if op is not None:   # a documented operation answers only as documented
            documented = set(op["responses"]) - ({"401"} if secret is None else set())
            assert str(r.status_code) in documented, (req, r.status_code, r.text[:300])
        if method == "HEAD" or r.status_code == 200 and r.url.path == "/metrics":
            return
        assert r.headers["content-type"].startswith("application/json"), (req, r.headers)
        body = json.loads(r.content)
        if r.status_code >= 400:
            assert isinstance(body["error"], str) and body["error"], (req, body)

    try:
        one()
    finally:
        client.close()
    # the fuzz reached past the happy path (and past the secret check, when there is one)
    assert {200, 400, 404, 405} | ({401} if secret else set()) <= seen, seen
    assert httpx.get(server.http_url + "/health", timeout=10).json()["status"] == "ok"
    assert "Traceback" not in server.log(), server.log()


RAW = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",  # 431
       b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n",                            # 431
       b"G\x00T /health HTTP/1.1\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
       b"GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\nabc",
       b"POST /cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
       b"GET /cache?limit=%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
       b"GET /cache?model=%00&after=-1 HTTP/1.1\r\nHost: x\r\n\r\n",
       b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
       b"DELETE /cache HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \x00\r\n\r\n"]


def test_malformed_raw_requests(server):
    """Bytes httpx would never send: each gets a 4xx status line (or a close), never a 5xx;
    a refused head has a bound (431); the log stays quiet and the server up."""
    import socket
    server, secret = server
    for raw in RAW:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            try:
                s.sendall(raw)
            except OSError:   # the server may refuse and close before all of it is sent
                pass
            try:
                line = s.recv(200).split(b"\r\n")[0]
            except ConnectionResetError:
                line = b""
        code = int(line.split()[1]) if line else None
        assert code is None or 200 <= code < 500, (raw[:60], line)
        if len(raw) > 64 << 10:
            assert code == 431, (raw[:60], line)
        if secret and (b"/status" in raw or b"DELETE" in raw):
            assert code in (400, 401), (raw[:60], line)
    assert httpx.get(server.http_url + "/health", timeout=10).json()["status"] == "ok"
    noise = [ln for ln in server.log().splitlines()
             if " INFO " not in ln and "--insecure: no secret" not in ln]   # the harness's
    assert not noise, noise
