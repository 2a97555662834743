"""Fuzzer: random and mutated messages at a live server. Every request gets a well-formed
reply (or, for a valid waiting lookup, none until its timeout), the server stays up and the
data committed before the fuzzing is intact afterwards."""
from __future__ import annotations

import socket

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvedit import protocol as P
from kvedit import wire
from kvedit.layout import DTYPE_SIZES, ModelLayout
from tests.fixtures_server import assert_seed_intact, data_port, link

keys = st.lists(st.binary(min_size=0, max_size=70), max_size=6)
models = st.sampled_from(["m", "other", ""]) | st.text(max_size=8)
small_int = st.integers(min_value=-2, max_value=64)
layouts = st.builds(ModelLayout, num_layers=small_int, num_kv_heads=small_int,
                    head_dim=st.sampled_from([0, 1, 64, 128, 100000]),
                    dtype=st.sampled_from([*DTYPE_SIZES, "float64", ""]),
                    chunk_size=st.sampled_from([256, 16, 0]), tp_rank=small_int,
                    tp_size=small_int)
requests = st.one_of(
    st.builds(P.Hello), st.builds(P.Stats), st.builds(P.ListModels),
    st.builds(P.Register, model=models, layout=layouts),
    st.builds(P.GetLayout, model=models, tp_rank=small_int),
    st.builds(P.Lookup, model=models, keys=keys, tp_rank=small_int,
              wait_timeout=st.sampled_from([0.0, -1.0, 0.01, float("nan"), float("inf")])),
    st.builds(P.PrepareStore, model=models, keys=keys, tp_rank=small_int),
    st.builds(P.Commit, store_id=st.integers(-1, 50)),
    st.builds(P.Abort, store_id=st.integers(-1, 50)),
    st.builds(P.Retrieve, model=models, keys=keys, tp_rank=small_int, with_data=st.booleans()),
    st.builds(P.Release, lease_id=st.integers(-1, 50)),
    st.builds(P.Delete, model=models, keys=keys, tp_rank=small_int),
    st.builds(P.Unregister, model=models.filter(lambda m: m != "m"), tp_rank=small_int),
)


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(P.encoder.encode(draw(requests)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[pos:pos + draw(st.integers(1, 8))]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


message_frames = st.one_of(
    st.builds(lambda r: [P.encoder.encode(r)], requests),
    st.builds(lambda m: [m], mutated()),
    st.lists(st.binary(max_size=64), min_size=0, max_size=3),   # random frames
    st.builds(lambda r, extra: [P.encoder.encode(r), *extra], requests,
              st.lists(st.binary(max_size=32), min_size=1, max_size=2)),
)


@pytest.fixture(scope="module")
def server(seeded_server):
    return seeded_server


@pytest.fixture(scope="module")
def sock(server):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.url)
    yield s
    s.close()
    ctx.term()


def _may_wait(payload: bytes) -> bool:
    """A valid Lookup with a real wait may legitimately stay unanswered for a while."""
    try:
        req = P.request_decoder.decode(payload)
    except msgspec.DecodeError:
        return False
    return isinstance(req, P.Lookup) and req.wait_timeout > 0


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=message_frames, n=st.integers(0, 2**32))
def test_fuzz_server(server, sock, frames, n):
    rid = n.to_bytes(8, "little")
    sock.send_multipart([rid, *frames])
    if not sock.poll(5000):
        assert frames and _may_wait(frames[0]), f"no reply to {frames!r}"
        return
    while True:  # skip late answers of earlier waiting lookups
        got = sock.recv_multipart()
        if got[0] in (rid, b""):
            break
    assert len(got) == 2
    reply = P.reply_decoder.decode(got[1])   # always a well-formed reply
    if not frames or len(frames) > 1:
        assert isinstance(reply, P.Error) and reply.code == "malformed"


link_payloads = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda op, pid, n, tail: wire.REQUEST.pack(wire.MAGIC, op, pid, n) + tail,
              st.integers(0, 255), st.integers(-2**63, 2**63 - 1), st.integers(0, 2**64 - 1),
              st.binary(max_size=32)),
)


@pytest.fixture(scope="module")
def link_port(server) -> int:
    return data_port(server)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=link_payloads)
def test_fuzz_data_link(server, link_port, payload):
    """Random requests on the data link: an error reply naming a protocol code, or a close;
    never an OK for bytes nobody was given, never a crash."""
    with link(server, port=link_port) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)   # end of input: the server must not wait for more
        got = bytearray()
        while chunk := conn.recv(65536):   # the server closes gently: no reset
            got += chunk
    if got:
        magic, status, _, n = wire.REPLY.unpack_from(got)
        assert magic == wire.MAGIC and status == wire.FAILED, bytes(got[:64])
        code = bytes(got[wire.REPLY.size:wire.REPLY.size + n]).decode().split(":")[0]
        assert code in P.ERROR_CODES, code


def test_server_survived_fuzzing(server):
    assert httpx.get(server.http_url + "/health", timeout=5).json()["status"] == "ok"
    assert_seed_intact(server)
    assert "internal error" not in server.log(), server.log()[-3000:]
