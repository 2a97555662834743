"""Issue 9 item 2: a client past its TTL can neither corrupt committed data nor use stale bytes.

The late writer here writes straight into the shared-memory segment (as a client that ignores
its deadline, or one paused by the OS, would); the fence must keep its old slot out of
anyone else's hands until it acknowledges (its late Commit) or disconnects.
"""
from __future__ import annotations

import mmap
import os
import secrets

import pytest

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from tests.fixtures_server import call, close_dealer, session_dealer, status, wait_until
from tests.kv_helpers import SMALL, chunk_for, key, matches

CHUNK = SMALL.chunk_bytes


@pytest.fixture
def server():
    # room for exactly 2 chunks; a long quarantine so only an ack or a disconnect ends it
    with start_server(2 * CHUNK / 2**30, extra_args=[
            "--write-ttl", "1", "--lease-ttl", "1", "--quarantine-ttl", "60",
            "--max-client-pool-fraction", "1"]) as s:
        with KVClient(s.url) as c:
            c.register("m", SMALL)
        yield s


def _scribble(server, offset: int) -> None:
    fd = os.open(f"/dev/shm/{server.shm_name}", os.O_RDWR)
    try:
        with mmap.mmap(fd, offset + CHUNK) as mm:
            mm[offset:offset + CHUNK] = b"\xee" * CHUNK
    finally:
        os.close(fd)


def test_late_shm_writer_cannot_corrupt_a_committed_chunk(server):
    late = session_dealer(server.url)
    try:
        slots = call(late, P.PrepareStore(model="m", keys=[key(0, "late")]))
        assert isinstance(slots, P.StoreSlots) and len(slots.offsets) == 1
        assert wait_until(lambda: status(server)["pending_stores"] == 0)   # past write TTL
        assert status(server)["quarantined_bytes"] == CHUNK
        with KVClient(server.url) as other:
            y = key(1, "other")
            other.store("m", [y], [chunk_for(y)])       # may not get the late writer's slot
            _scribble(server, slots.offsets[0])         # the late writer fills its old buffer
            with other.retrieve("m", [y]) as r:
                assert matches(y, r.tensors[0])
                # y leased, the other slot quarantined: the pool has no room, and the store is
                # refused rather than given the quarantined slot
                z = key(2, "other")
                with pytest.raises(KVError) as e:
                    other.store("m", [z], [chunk_for(z)])
                assert e.value.code == "pool_full", e.value
            reply = call(late, P.Commit(store_id=slots.store_id))
            assert isinstance(reply, P.Error) and reply.code == "store_expired", reply
            assert status(server)["quarantined_bytes"] == 0   # the ack ended the quarantine
            other.store("m", [z], [chunk_for(z)])
            assert other.lookup("m", [key(0, "late")]) == 0
    finally:
        close_dealer(late)


def test_quarantine_ends_when_the_holder_disconnects(server):
    late = session_dealer(server.url)
    slots = call(late, P.PrepareStore(model="m", keys=[key(0, "gone")]))
    assert isinstance(slots, P.StoreSlots)
    assert wait_until(lambda: status(server)["quarantined_bytes"] == CHUNK)
    close_dealer(late)   # its last socket: nothing can write late any more
    assert wait_until(lambda: status(server)["quarantined_bytes"] == 0, timeout=10)
    assert status(server)["pool_used"] == 0


def test_reader_past_lease_ttl_is_told_at_release(server):
    with KVClient(server.url) as c:
        x = key(0, "reader")
        c.store("m", [x], [chunk_for(x)])
    reader = session_dealer(server.url)
    try:
        leased = call(reader, P.Retrieve(model="m", keys=[x]))
        assert isinstance(leased, P.Leased) and leased.count == 1
        assert wait_until(lambda: status(server)["leases"] == 0)   # past lease TTL
        reply = call(reader, P.Release(lease_id=leased.lease_id))
        assert isinstance(reply, P.Error) and reply.code == "lease_expired", reply
        assert "discard" in reply.message
    finally:
        close_dealer(reader)


def test_stores_and_leases_belong_to_their_session(server):
    owner, stranger = session_dealer(server.url), session_dealer(server.url)
    try:
        slots = call(owner, P.PrepareStore(model="m", keys=[key(0, "own")]))
        for msg in (P.Commit(store_id=slots.store_id), P.Abort(store_id=slots.store_id)):
            reply = call(stranger, msg)
            assert isinstance(reply, P.Error) and reply.code == "not_holder", reply
        assert isinstance(call(owner, P.Commit(store_id=slots.store_id)), P.Committed)
        leased = call(owner, P.Retrieve(model="m", keys=[key(0, "own")]))
        reply = call(stranger, P.Release(lease_id=leased.lease_id))
        assert isinstance(reply, P.Error) and reply.code == "not_holder"
        assert isinstance(call(owner, P.Release(lease_id=leased.lease_id)), P.Ok)
        # ids are not sequential: two stores in a row are far apart
        a = call(owner, P.PrepareStore(model="m", keys=[key(1, "own")])).store_id
        b = call(owner, P.PrepareStore(model="m", keys=[key(2, "own")])).store_id
        assert abs(a - b) > 2**20
    finally:
        for d in (owner, stranger):
            close_dealer(d)


def test_a_session_spans_its_sockets(server):
    session = secrets.token_bytes(16)
    a, b = session_dealer(server.url, session, 0), session_dealer(server.url, session, 1)
    try:
        slots = call(a, P.PrepareStore(model="m", keys=[key(0, "span")]))
        assert isinstance(call(b, P.Abort(store_id=slots.store_id)), P.Ok)
    finally:
        close_dealer(a)
        close_dealer(b)


@pytest.mark.slow  # real-time waits for the quarantine
def test_quarantine_waits_for_the_last_socket_of_the_session(server):
    session = secrets.token_bytes(16)
    first, second = session_dealer(server.url, session, 0), session_dealer(server.url, session, 1)
    try:
        assert isinstance(call(second, P.Hello(protocol=P.PROTOCOL)), P.ServerInfo)   # both sockets known
        slots = call(first, P.PrepareStore(model="m", keys=[key(0, "two")]))
        assert isinstance(slots, P.StoreSlots)
        assert wait_until(lambda: status(server)["quarantined_bytes"] == CHUNK)
        close_dealer(first)
        # the session still has a socket: it may still write, so the slot stays fenced
        assert not wait_until(lambda: status(server)["quarantined_bytes"] == 0, timeout=2)
    finally:
        close_dealer(second)
    assert wait_until(lambda: status(server)["quarantined_bytes"] == 0, timeout=10)


def test_other_clients_coming_and_going_do_not_drop_a_live_session(server):
    waiting = session_dealer(server.url)
    try:
        k = key(0, "awaited")
        waiting.send_multipart([b"w", P.encoder.encode(
            P.Lookup(model="m", keys=[k], wait_timeout=30))])
        assert wait_until(lambda: status(server)["waiting_lookups"] == 1)
        for _ in range(30):          # churn: descriptors are freed and reused
            d = session_dealer(server.url)
            assert isinstance(call(d, P.Hello(protocol=P.PROTOCOL)), P.ServerInfo)
            close_dealer(d)
        assert status(server)["waiting_lookups"] == 1
        with KVClient(server.url) as c:
            c.store("m", [k], [chunk_for(k)])
        rid, reply = waiting.recv_multipart()
        assert rid == b"w" and P.reply_decoder.decode(reply) == P.Count(n=1)
    finally:
        close_dealer(waiting)
