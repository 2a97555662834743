"""A client and a server of different kvedit releases, against a real server process and a
stand-in for an older one (kvedit/protocol.py PROTOCOL, kvedit/client/kv_client.py).

Before, messages forbade unknown fields and nothing said which version a peer spoke: an older
client failed to decode a newer server's ServerInfo ("unknown field") and the reverse, with
no word about versions. Now Hello carries the client's protocol and a server of another
answers with an error naming both, which every client since the first can decode; a client
facing a server from before versions says so.
"""
from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from tests.fixtures_server import call, close_dealer, dealer


@pytest.fixture(scope="module")
def server():
    with start_server(0.02) as s:
        yield s


def test_a_client_of_another_protocol_is_told_both_versions(server):
    d = dealer(server.url)
    try:
        old = call(d, P.Hello())   # a client from before versions: no field
        assert isinstance(old, P.Error) and old.code == "protocol", old
        assert f"protocol 1, the server" in old.message and f"speaks {P.PROTOCOL}" in \
            old.message
        future = P.encoder.encode({"t": "hello", "protocol": P.PROTOCOL + 7, "wants": [1, 2]})
        d.send_multipart([b"f", future])   # a later client: more fields, still decoded
        rid, raw = d.recv_multipart()
        r = P.reply_decoder.decode(raw)
        assert isinstance(r, P.Error) and r.code == "protocol", r
        assert f"protocol {P.PROTOCOL + 7}" in r.message
        info = call(d, P.Hello(protocol=P.PROTOCOL))
        assert isinstance(info, P.ServerInfo) and info.protocol == P.PROTOCOL
    finally:
        close_dealer(d)


class _OlderServer:
    """A ROUTER answering as a server from before versions did: its Hello had no fields and
    forbade unknown ones, so a newer client's Hello got `malformed`."""

    class Hello(msgspec.Struct, tag="hello", tag_field="t", forbid_unknown_fields=True):
        pass

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        dec = msgspec.msgpack.Decoder(self.Hello)
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            ident, rid, body = self.sock.recv_multipart()
            try:
                dec.decode(body)
                reply = P.Error(code="internal", message="not expected in this test")
            except msgspec.ValidationError as e:
                reply = P.Error(code="malformed", message=f"cannot decode the message frame "
                                                          f"as a kvedit request: {e}")
            self.sock.send_multipart([ident, rid, P.encoder.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_a_client_facing_a_server_from_before_versions_says_so():
    old = _OlderServer()
    try:
        with pytest.raises(KVError) as e:
            KVClient(f"tcp://127.0.0.1:{old.port}", timeout=5)
        assert e.value.code == "protocol"
        assert "older protocol (1, before versions)" in e.value.message
        assert f"this client speaks {P.PROTOCOL}" in e.value.message
    finally:
        old.close()


def test_kvclient_speaks_the_server_s_protocol(server):
    with KVClient(server.url) as c:
        assert c.server_info().protocol == P.PROTOCOL
