"""Control-loop latency: a small request (Hello) while max-size requests are handled.

The server's loop handles one message at a time, so the largest request it accepts bounds how
long a small one waits behind it. This starts a server with the given
--max-keys-per-request, stores that many tiny chunks, then for each kind of max-size request
(lookup and retrieve of ready keys, delete of absent keys) sends them back to back from one
socket while another socket times Hello; the baseline is Hello on the idle server, measured
in the same run. Also: Hello right after a message over --max-message-bytes (libzmq drops it
with its connection; the loop never sees it).
"""
from __future__ import annotations

import json
import secrets
import statistics
import threading
import time

import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout

TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", chunk_size=256)


def register(bsub) -> None:
    p = bsub.add_parser("loop", help="Hello latency while max-size requests are handled",
                        description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=8192,
                   help="keys per request = the server's --max-keys-per-request (default 8192)")
    p.add_argument("--seconds", type=float, default=5.0, help="per request kind (default 5)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def _dealer(ctx: zmq.Context, url: str, secret: bytes | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(20))
    if secret is not None:   # the server made a secret of its own (the default): CURVE
        auth.curve_client(s, secret)
    s.connect(url)
    return s


# A reply later than this is a server that stopped answering: say so rather than wait
CALL_TIMEOUT_S = 30.0


def _call(s: zmq.Socket, msg):
    rid = secrets.token_bytes(8)
    s.send_multipart([rid, P.encoder.encode(msg)])
    end = time.monotonic() + CALL_TIMEOUT_S
    while (left := end - time.monotonic()) > 0 and s.poll(int(left * 1000) + 1):
        got, reply = s.recv_multipart()
        if got == rid:
            return P.reply_decoder.decode(reply)
    raise SystemExit(f"kvedit bench loop: no reply to {type(msg).__name__} within "
                     f"{CALL_TIMEOUT_S:.0f} s (a server that refuses this client's "
                     f"authentication answers nothing)")


def _hellos(s: zmq.Socket, seconds: float) -> list[float]:
    lat, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        _call(s, P.Hello(protocol=P.PROTOCOL))
        lat.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.005)
    return sorted(lat)


def _summary(lat: list[float]) -> dict:
    return {"hello_p50_ms": round(lat[len(lat) // 2], 2),
            "hello_p99_ms": round(lat[int(len(lat) * 0.99)], 2),
            "hello_max_ms": round(lat[-1], 2), "hellos": len(lat)}


def measure(keys: int, seconds: float) -> dict:
    pool_gb = keys * 2 * 4096 / 2**30 + 0.01   # two sets of 4 KiB slots
    with start_server(pool_gb, extra_args=["--max-keys-per-request", str(keys)]) as srv:
        ctx = zmq.Context()
        secret = auth.load_secret(secret_file=srv.secret_file) if srv.secret_file else None
        big, small = _dealer(ctx, srv.url, secret), _dealer(ctx, srv.url, secret)
        try:
            _call(big, P.Register(model="t", layout=TINY))
            ks = [secrets.token_bytes(16) for _ in range(keys)]
            slots = _call(big, P.PrepareStore(model="t", keys=ks))
            _call(big, P.Commit(store_id=slots.store_id))
            idle = _summary(_hellos(small, seconds))
            out = {"keys_per_request": keys, "idle": idle}
            absent = [secrets.token_bytes(16) for _ in range(keys)]
            for name, msg in (("lookup", P.Lookup(model="t", keys=ks)),
                              ("retrieve", P.Retrieve(model="t", keys=ks)),
                              ("delete_absent", P.Delete(model="t", keys=absent))):
                durations, stop = [], threading.Event()

                def pound():
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        r = _call(big, msg)
                        durations.append(time.perf_counter() - t0)
                        if isinstance(r, P.Leased):
                            _call(big, P.Release(lease_id=r.lease_id))

                th = threading.Thread(target=pound)
                th.start()
                lat = _hellos(small, seconds)
                stop.set()
                th.join()
                out[name] = {"request_ms_median": round(statistics.median(durations) * 1e3, 2),
                             **_summary(lat),
                             "hello_p99_vs_idle": round(lat[int(len(lat) * 0.99)] /
                                                        max(idle["hello_p99_ms"], 1e-3), 2)}
            over = _dealer(ctx, srv.url, secret)
            over.send_multipart([b"x", b"\0" * (srv_max_message_bytes(small) + 1)])
            t0 = time.perf_counter()
            _call(small, P.Hello(protocol=P.PROTOCOL))
            out["hello_after_oversized_message_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
            over.close(linger=0)
        finally:
            big.close(linger=0)
            small.close(linger=0)
            ctx.term()
    return out


def srv_max_message_bytes(s: zmq.Socket) -> int:
    return _call(s, P.Hello(protocol=P.PROTOCOL)).max_message_bytes


def run(args) -> int:
    out = measure(args.keys, args.seconds)
    if not args.json:
        print(__doc__.splitlines()[0])
    print(json.dumps(out, indent=None if args.json else 1))
    return 0
