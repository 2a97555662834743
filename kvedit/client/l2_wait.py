"""Wait until a kvedit server's second tier holds what was committed so far (client side;
reads GET /status, imports nothing from kvedit.server).

Write-behind is asynchronous: a chunk committed on server A reaches Redis a little later.
Before another server (engine B) is asked for chunks that A just stored, e.g. the edited KV
of a prefill-edit-decode hand-off, call `wait_l2_written(A's http_url)`: it returns once A's
write-behind queue is empty and nothing is being sent, which holds every commit made before
the call (a write dropped at the queue bound or skipped because L1 evicted it first is
counted in the returned `l2` object, not waited for).
The bearer token (derived from the secret for HTTP only) goes only to a server that first
proved, on the same connection, that it knows the secret and answers on the endpoint this
client reached (kvedit.client.http_proof): a process squatting the port, or relaying
another server's proof, gets none.
"""
from __future__ import annotations

import json
import time

from kvedit import auth
from kvedit.client.http_proof import NotProven, found, proven


class L2NotWritten(TimeoutError):
    """The server's write-behind did not drain in time (Redis down or slow)."""


def wait_l2_written(http_url: str, timeout: float = 60.0, secret: str | None = None,
                    poll: float = 0.01) -> dict:
    """Block until the server at `http_url` has written its queued chunks to L2 -> its
    /status "l2" object. Raises L2NotWritten (with that object) after `timeout` seconds and
    ValueError when the server runs without --l2-url. Without `secret`, a loopback server
    that made its own (kvedit.rundir) is recognised by its proof."""
    deadline = time.monotonic() + timeout
    key = secret.encode() if secret else None
    try:
        if key is not None:
            conn, _ = proven(http_url, key, timeout=10)
        else:   # a loopback server of this user: its secret is found by its proof
            conn, _, key = found(http_url, timeout=10)
    except NotProven as e:
        raise ValueError(f"{e}: not sending it a bearer token") from None
    headers = auth.bearer_header(key)
    try:
        while True:
            conn.request("GET", "/status", headers=headers)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise ValueError(f"GET {http_url}/status answered {r.status}: {body[:200]!r}")
            l2 = _l2_status(http_url, json.loads(body), deadline, timeout)
            if l2 is not None:
                return l2
            time.sleep(poll)   # a background thread drains the queue; nothing to be woken by
    finally:
        conn.close()


def _l2_status(http_url: str, st: dict, deadline: float, timeout: float) -> dict | None:
    """/status's "l2" object once the write-behind is drained; None to poll again."""
    l2 = st.get("l2")
    if l2 is None:
        raise ValueError(f"the kvedit server at {http_url} has no second tier (start it "
                         f"with --l2-url redis://...)")
    if l2["up"] and l2["queue"]["depth"] == 0 and not l2["writing"]:
        return l2
    if time.monotonic() > deadline:
        raise L2NotWritten(f"the kvedit server at {http_url} still had {l2['queue']['depth']}"
                           f" chunk(s) to write to L2 after {timeout} s (L2 up: "
                           f"{l2['up']}): {l2}")
    return None
