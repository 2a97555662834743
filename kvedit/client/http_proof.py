"""An HTTP connection to a kvedit server that proved, on it, that it knows the secret.

Why a module of its own: every client that talks to the HTTP API with a secret (the SDK's
connect, `wait_l2_written`, tools) must check the server first, the same way, before it
sends a token: /health answers a fresh challenge with an HMAC that covers the endpoint the
server answers on (kvedit.auth.http_proof), and the client compares it with the address and
port its own socket is connected to. A process squatting a port the client was told about
(a stopped server's, or [::1] where the real server listens on 127.0.0.1) cannot answer,
and a proof it relays from a real server with the same secret names that server's
endpoint, not the one the client connected to: the client hangs up having sent nothing but
the challenge. Behind a proxy, NAT or port mapping the server sees another endpoint than
the client, and the client refuses with both named (connect to the server's own address).
A client given no secret for a loopback server tries the secrets this user's servers left in
the runtime directory (kvedit.rundir) against the proof: the one that holds is the server's
(`found`), as a KVClient finds a loopback server's by its ZMQ port.
Stdlib only (http.client): the socket's peer address is what the proof is checked against.
"""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from kvedit import auth, rundir


class NotProven(ConnectionError):
    """The server at the URL did not prove it knows the secret on this endpoint; nothing
    was sent to it but the challenge."""


def proven(http_url: str, secret: bytes | None, timeout: float = 10.0
           ) -> tuple[http.client.HTTPConnection, dict]:
    """(an open connection to `http_url`'s server, its /health answer). With a secret, the
    answer proved the secret on the endpoint this connection reached, or NotProven; send
    the bearer token (auth.bearer_header) on this connection only. OSError when nothing
    answers; ValueError for a URL that is not http://host:port."""
    conn, health, _ = _proven(http_url, secret, timeout, ())
    return conn, health


def found(http_url: str, timeout: float = 10.0
          ) -> tuple[http.client.HTTPConnection, dict, bytes | None]:
    """`proven` for a client given no secret: (connection, /health answer, the secret of this
    user's that the server proved on this endpoint, or None: a server without one, or not
    this user's)."""
    host = urlsplit(http_url).hostname or ""
    mine = rundir.secrets_here() if rundir.is_loopback_host(host) else []
    return _proven(http_url, None, timeout, mine)


def _proven(http_url: str, secret: bytes | None, timeout: float, candidates
            ) -> tuple[http.client.HTTPConnection, dict, bytes | None]:
    u = urlsplit(http_url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"the kvedit HTTP URL must be http://host:port, got {http_url!r}")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        challenge = auth.http_challenge()
        conn.request("GET", "/health", headers={auth.CHALLENGE_HEADER: challenge})
        where = auth.endpoint(conn.sock.getpeername())   # what this client reached
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise NotProven(f"{http_url}/health answered {r.status}: {body[:200]!r}")
        if secret is not None:
            _check(http_url, secret, challenge, where, r)
        proof = r.getheader(auth.PROOF_HEADER)
        for s in candidates if secret is None and proof else ():
            if auth.check_http_proof(s, challenge, proof, where):
                secret = s
                break
        return conn, json.loads(body), secret
    except BaseException:
        conn.close()
        raise


def _check(http_url: str, secret: bytes, challenge: str, where: str, r) -> None:
    version = r.getheader(auth.AUTH_HEADER)
    if version != str(auth.HTTP_AUTH):
        raise NotProven(
            f"{http_url} answers /health but cannot prove it knows the kvedit secret on this "
            f"endpoint: it speaks HTTP auth {version or '1 (no ' + auth.AUTH_HEADER + ')'}, "
            f"this client {auth.HTTP_AUTH} (a kvedit server from before HTTP auth "
            f"{auth.HTTP_AUTH}, or not a kvedit server: run both from the same kvedit "
            f"release); no token was sent")
    if auth.check_http_proof(secret, challenge, r.getheader(auth.PROOF_HEADER), where):
        return
    named = r.getheader(auth.ENDPOINT_HEADER)
    if named and named != where:
        raise NotProven(
            f"{http_url} cannot prove it knows the kvedit secret on this endpoint: this "
            f"client reached {where} but the proof names {named} (another process on this "
            f"port relaying a kvedit server, or a proxy/NAT in between: connect to the "
            f"server's own address); no token was sent")
    raise NotProven(f"{http_url} answers /health but cannot prove it knows the kvedit secret "
                    f"this client uses (no or a wrong {auth.PROOF_HEADER}): not this kvedit "
                    f"server (another process on the port, or a server with another secret or "
                    f"none); no token was sent")
