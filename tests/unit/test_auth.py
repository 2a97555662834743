"""kvedit.auth on its own: secret loading, CURVE keys and sockets, data-link handshake, bearer."""
from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
import zmq

from kvedit import auth

SECRET = b"s3cret-token-for-tests-0123456789"
OTHER = b"another-secret-0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)


# ---- secret -----------------------------------------------------------------------------
def test_load_secret_sources_and_precedence(tmp_path, monkeypatch):
    assert auth.load_secret() is None
    path = tmp_path / "s"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o600)
    assert auth.load_secret(secret_file=path) == SECRET
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(path))
    assert auth.load_secret() == SECRET
    monkeypatch.setenv(auth.SECRET_ENV, OTHER.decode())
    assert auth.load_secret() == OTHER                  # the secret itself wins over a file
    assert auth.load_secret(secret=SECRET.decode()) == SECRET  # the argument wins over env
    with pytest.raises(auth.AuthError, match="not both"):
        auth.load_secret(secret=SECRET, secret_file=path)


@pytest.mark.parametrize("bad", [b"short", b"has a space in it 12345", b"x" * 5000,
                                 "é".encode() * 20])
def test_unusable_secrets_are_refused_with_the_rule(bad):
    with pytest.raises(auth.AuthError, match="printable ASCII"):
        auth.load_secret(secret=bad)


def test_missing_secret_file_names_the_path(tmp_path):
    with pytest.raises(auth.AuthError, match=str(tmp_path / "nope")):
        auth.load_secret(secret_file=tmp_path / "nope")


def test_generate_secret_is_0600_random_and_never_overwrites(tmp_path):
    a = auth.generate_secret(tmp_path / "a")
    b = auth.generate_secret(tmp_path / "b")
    assert a != b and len(a) == 64
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o600
    assert auth.load_secret(secret_file=tmp_path / "a") == a
    with pytest.raises(auth.AuthError, match="exists"):
        auth.generate_secret(tmp_path / "a")
    assert auth.load_secret(secret_file=tmp_path / "a") == a


# ---- CURVE --------------------------------------------------------------------------------
def test_derived_keys_are_stable_distinct_and_valid():
    srv, cli = auth.curve_keys(SECRET, "server"), auth.curve_keys(SECRET, "client")
    assert srv == auth.curve_keys(SECRET, "server")           # same secret -> same keys
    assert srv != cli and srv != auth.curve_keys(OTHER, "server")
    for pub, sec in (srv, cli):
        assert len(pub) == len(sec) == 40
        assert zmq.curve_public(sec) == pub
    long_secret = b"L" * 200                                   # longer than a blake2b key
    assert auth.curve_keys(long_secret, "client") != auth.curve_keys(b"L" * 199, "client")


def _curve_pair(server_secret: bytes, client_secret: bytes | None, timeout_ms: int):
    """A CURVE REP server and a REQ client on loopback -> the reply or None (no reply)."""
    ctx = zmq.Context()
    authenticator = auth.start_authenticator(ctx, server_secret)
    rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    try:
        auth.curve_server(rep, server_secret)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        if client_secret is not None:
            auth.curve_client(req, client_secret)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        if not rep.poll(timeout_ms):
            return None
        rep.send(rep.recv() + b"-pong")
        return req.recv() if req.poll(timeout_ms) else None
    finally:
        rep.close(0)
        req.close(0)
        authenticator.stop()
        ctx.term()


def test_curve_pair_with_the_right_secret_talks():
    assert auth.zmq.has("curve")
    assert _curve_pair(SECRET, SECRET, 5000) == b"ping-pong"


@pytest.mark.parametrize("client_secret", [OTHER, None])
def test_curve_pair_with_a_wrong_or_no_secret_gets_nothing(client_secret):
    assert _curve_pair(SECRET, client_secret, 700) is None


def test_authenticator_refuses_a_client_with_its_own_keypair_and_the_server_key():
    """Knowing the server's public key is not enough: ZAP admits only the derived client key."""
    ctx = zmq.Context()
    authenticator = auth.start_authenticator(ctx, SECRET)
    rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    try:
        auth.curve_server(rep, SECRET)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        pub, sec = zmq.curve_keypair()
        req.curve_publickey, req.curve_secretkey = pub, sec
        req.curve_serverkey = auth.curve_keys(SECRET, "server")[0]
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        assert not rep.poll(700)
    finally:
        rep.close(0)
        req.close(0)
        authenticator.stop()
        ctx.term()


# ---- data-link handshake --------------------------------------------------------------------
def _handshake(server_secret, client_secret, session=b"S" * 16):
    """-> (what the server side returned or raised, what the client side raised or None)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    client_error = []

    def client():
        try:
            auth.client_handshake(b, client_secret, session)
        except auth.AuthError as e:   # it hangs up, as the data link client does
            client_error.append(e)
            b.close()

    t = threading.Thread(target=client)
    t.start()
    try:
        try:
            got = auth.server_handshake(a, server_secret)
        except auth.AuthError as e:
            got = e
        return got, (client_error[0] if client_error else None)
    finally:
        t.join()
        a.close()
        b.close()


def test_handshake_accepts_the_right_secret_and_returns_the_session():
    assert _handshake(SECRET, SECRET, b"0123456789abcdef") == (b"0123456789abcdef", None)


def test_handshake_refuses_a_missing_secret():
    got, client = _handshake(SECRET, None)
    assert isinstance(got, auth.AuthError) and "wrong or missing secret" in str(got)
    assert client is None   # without a secret the client cannot check the server


def test_a_client_refuses_a_server_that_cannot_prove_the_secret():
    """Another secret, or none (a process squatting the port): the client hangs up before
    it sends a MAC, so the server side only ever sees the connection close."""
    for server_secret in (OTHER, None):
        got, client = _handshake(server_secret, SECRET)
        assert isinstance(client, auth.AuthError) and "did not prove" in str(client)
        assert isinstance(got, auth.AuthError) and "closed" in str(got)


def test_handshake_without_a_server_secret_still_reads_the_session():
    assert _handshake(None, None, b"x" * 16) == (b"x" * 16, None)


def test_link_macs_are_bound_to_both_nonces_the_side_the_session_and_the_port():
    """A recorded MAC cannot be replayed on another connection (two fresh nonces), passed off
    as the other side's, or relayed to a server on another port."""
    base = ("server", b"n" * 32, b"c" * 32, b"z" * 16, 6000)
    mac = auth.link_mac(SECRET, *base)
    for i, other in ((0, "client"), (1, b"m" * 32), (2, b"d" * 32), (3, b"y" * 16), (4, 6001)):
        changed = list(base)
        changed[i] = other
        assert auth.link_mac(SECRET, *changed) != mac, i
    assert auth.link_mac(None, *base) == bytes(auth.MAC_BYTES)


def test_a_squatting_server_gets_no_mac():
    """What a client with the secret sends to a server without it: a nonce and its session,
    never a MAC of the secret."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    try:
        a.sendall(b"N" * auth.NONCE_BYTES)           # the squatter's nonce
        a.sendall(bytes(auth.MAC_BYTES))             # ... and a made-up proof
        with pytest.raises(auth.AuthError, match="did not prove"):
            auth.client_handshake(b, SECRET, b"s" * 16)
        b.close()
        got = a.recv(4096)
        rest = a.recv(4096)
        assert len(got) == auth.NONCE_BYTES + auth.SESSION_BYTES and rest == b""
    finally:
        a.close()
        b.close()


def test_handshake_short_answer_is_an_auth_error():
    a, b = socket.socketpair()
    a.settimeout(5)
    try:
        b.sendall(b"tooshort")
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(auth.AuthError, match="closed"):
            auth.server_handshake(a, SECRET)
    finally:
        a.close()
        b.close()


# ---- HTTP ---------------------------------------------------------------------------------
def test_http_bearer_check():
    """The bearer is a token derived from the secret for HTTP only; the secret itself is
    refused (and recognised, so an old client is told why)."""
    tok = auth.http_token(SECRET)
    assert len(tok) == 64 and SECRET.decode() not in tok and tok != auth.http_token(OTHER)
    assert auth.http_authorized(None, None)                  # no secret: open
    assert auth.http_authorized(f"Bearer {tok}", SECRET)
    assert auth.http_authorized(f"bearer  {tok} ", SECRET)
    assert auth.bearer_header(SECRET) == {"Authorization": f"Bearer {tok}"}
    raw = f"Bearer {SECRET.decode()}"
    for bad in (None, "", tok, f"Basic {tok}", f"Bearer {auth.http_token(OTHER)}", "Bearer ",
                "Bearer é", raw):
        assert not auth.http_authorized(bad, SECRET), bad
    assert auth.sent_raw_secret(raw, SECRET) and not auth.sent_raw_secret(f"Bearer {tok}", SECRET)


def test_http_proof_names_its_endpoint():
    c = auth.http_challenge()
    proof = auth.http_proof(SECRET, c, "127.0.0.1:8080")
    assert auth.check_http_proof(SECRET, c, proof, "127.0.0.1:8080")
    for where in ("127.0.0.1:8081", "[::1]:8080", "127.0.0.2:8080"):   # a relay elsewhere
        assert not auth.check_http_proof(SECRET, c, proof, where), where
    assert not auth.check_http_proof(OTHER, c, proof, "127.0.0.1:8080")
    assert auth.endpoint(("::ffff:127.0.0.1", 80, 0, 0)) == "127.0.0.1:80"
    assert auth.endpoint(("::1", 80, 0, 0)) == "[::1]:80"
    assert auth.endpoint(("fe80::1%lo", 80)) == "[fe80::1]:80"
