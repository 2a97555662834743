"""The shared secret and the three places it is checked: ZMQ control, the data link, HTTP.

One secret (a token of printable ASCII, at least 16 characters) authenticates every door:
- ZMQ control: CurveZMQ. Both key pairs are derived from the secret (keyed blake2b with a
  distinct personalisation each), so nothing but the secret has to be distributed; the
  server's ZAP handler (a ThreadAuthenticator) admits exactly the derived client public key.
  CURVE also encrypts, which is what makes a non-loopback bind safe.
- data link: mutual. The server sends a nonce, the client its own nonce and its session id;
  the server proves it knows the secret first (an HMAC over both nonces, the session and its
  port), and only then does the client answer with its own HMAC. So a process squatting the
  port without the secret gets nothing it could replay: the client hangs up before sending
  a MAC, and a MAC it relays to the real server is bound to nonces and a port it cannot
  reuse.
- HTTP: `Authorization: Bearer <token>` on the endpoints that list, read or change data,
  where the token is derived from the secret for HTTP alone (`http_token`): the secret
  never crosses HTTP. A client first asks /health to prove it knows the secret and answers
  on the endpoint the client connected to (`http_proof`: an HMAC over the client's
  challenge and that address and port), and sends the token only after that, on the same
  connection (kvedit.client.http_proof).
Without a secret the ZMQ sockets use the NULL mechanism and the handshake still carries the
session id (unchecked), so holder checks work the same on a loopback-only server. A client
that has a secret refuses a server that cannot prove it has the same one.
Where a client's secret comes from (`SecretSource`): the argument, the environment, then the
file a same-user server started without one left for its port (kvedit.rundir); a source that
names a file is read again when a client reconnects (a restarted server may have another).
This module imports nothing of kvedit but kvedit.rundir, so the server, the client and HTTP
can all use it.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets as _secrets
import socket
import stat

import zmq
from zmq.utils import z85

from kvedit import rundir

__all__ = ["AuthError", "SECRET_ENV", "SECRET_FILE_ENV", "NONCE_BYTES", "SESSION_BYTES",
           "MAC_BYTES", "SecretSource", "load_secret", "make_secret", "generate_secret",
           "l2_mac_key", "curve_keys", "curve_server",
           "start_authenticator", "curve_client", "server_handshake", "client_handshake",
           "link_mac", "http_authorized", "bearer_header", "http_challenge", "http_proof",
           "check_http_proof", "http_token", "sent_raw_secret", "endpoint", "HTTP_AUTH",
           "CHALLENGE_HEADER", "PROOF_HEADER", "AUTH_HEADER", "ENDPOINT_HEADER"]
log = logging.getLogger("kvedit.auth")

SECRET_ENV = "KVEDIT_SECRET"            # the secret itself
SECRET_FILE_ENV = "KVEDIT_SECRET_FILE"  # a file holding it
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096
NONCE_BYTES, SESSION_BYTES, MAC_BYTES = 32, 16, 32
_SERVER_PERSON, _CLIENT_PERSON = b"kvedit-zmq-srv", b"kvedit-zmq-cli"
_L2_PERSON = b"kvedit-l2-mac"
_LINK_SERVER, _LINK_CLIENT = b"kvedit-link-server", b"kvedit-link-client"
_HTTP_SERVER = b"kvedit-http-server"
_HTTP_TOKEN_PERSON, _HTTP_PROOF_PERSON = b"kvedit-http-tok", b"kvedit-http-prf"
CHALLENGE_HEADER, PROOF_HEADER = "X-Kvedit-Challenge", "X-Kvedit-Proof"
# /health also says which HTTP auth it speaks and the endpoint its proof names
AUTH_HEADER, ENDPOINT_HEADER = "X-Kvedit-Auth", "X-Kvedit-Endpoint"


class AuthError(Exception):
    """A peer failed authentication, or a secret is unusable; the message says which."""


# ---- the secret ----------------------------------------------------------------------
def _check(secret: bytes, where: str) -> bytes:
    # printable ASCII without spaces: it must survive a file, an env variable and an HTTP header
    printable = all(33 <= b < 127 for b in secret)
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS or not printable:
        raise AuthError(f"the kvedit secret from {where} must be {MIN_SECRET_CHARS}-"
                        f"{MAX_SECRET_CHARS} printable ASCII characters without spaces "
                        f"(got {len(secret)} bytes); make one with "
                        f"`kvedit server --gen-secret PATH`")
    return secret


def _read_file(path: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_CHARS + 2).strip()
    except OSError as e:
        raise AuthError(f"cannot read the kvedit secret file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("kvedit secret file %s is readable by group/others (mode %o); chmod 600 it",
                    path, st.st_mode & 0o777)
    return _check(data, path)


def load_secret(secret: str | bytes | None = None, secret_file: str | os.PathLike | None = None,
                *, url: str | None = None) -> bytes | None:
    """The secret from the arguments, else $KVEDIT_SECRET, else $KVEDIT_SECRET_FILE, else
    (a client naming its server's `url`) the file the server on that loopback port made at
    start (kvedit.rundir); None if none.

    An explicit argument wins over the environment; a secret given both ways at one level
    (secret and secret_file) is refused as ambiguous."""
    return SecretSource(secret, secret_file, url=url).read()


class SecretSource:
    """Where a client's secret comes from, read again on demand (`read`).

    A secret given as such (argument, $KVEDIT_SECRET) never changes; one that lives in a
    file (secret_file, $KVEDIT_SECRET_FILE, or the runtime directory's file of a loopback
    server's port, kvedit.rundir) is read again each time, so a client reconnecting to a
    restarted server finds the secret it uses now."""

    def __init__(self, secret: str | bytes | None = None,
                 secret_file: str | os.PathLike | None = None, *, url: str | None = None):
        if secret is not None and secret_file is not None:
            raise AuthError("give the kvedit secret or a secret file, not both")
        self.fixed: bytes | None = None
        self.file: str | None = None
        self.url = url
        if secret is not None:
            self.fixed = _check(secret.encode() if isinstance(secret, str) else bytes(secret),
                                "the argument")
        elif secret_file is not None:
            self.file = os.fspath(secret_file)
        elif os.environ.get(SECRET_ENV):
            self.fixed = _check(os.environ[SECRET_ENV].strip().encode(), f"${SECRET_ENV}")
        elif os.environ.get(SECRET_FILE_ENV):
            self.file = os.environ[SECRET_FILE_ENV]

    @property
    def rereads(self) -> bool:
        """Whether `read` may give another secret later (a file, or the runtime directory)."""
        return self.fixed is None

    def read(self) -> bytes | None:
        """The secret now; None if there is none (a loopback server's file not there)."""
        if self.fixed is not None:
            return self.fixed
        if self.file is not None:
            return _read_file(self.file)
        found = rundir.lookup(self.url) if self.url else None
        return None if found is None else _check(found[0], str(found[1]))


def make_secret() -> bytes:
    """A new random secret: 64 hex characters."""
    return _secrets.token_hex(32).encode()


def generate_secret(path: str | os.PathLike) -> bytes:
    """Write a new random secret (64 hex characters) to `path`, mode 0600, and return it.

    Refuses to overwrite an existing file (O_EXCL): a running deployment's secret is not
    replaced by accident."""
    secret = make_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AuthError(f"{os.fspath(path)} exists; remove it first or use it with "
                        f"--secret-file") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret


# ---- ZMQ: CurveZMQ with keys derived from the secret ---------------------------------
def _derive(secret: bytes, person: bytes) -> bytes:
    key = secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()  # blake2b key <= 64 B
    return hashlib.blake2b(b"", key=key, person=person, digest_size=32).digest()


def l2_mac_key(secret: bytes) -> bytes:
    """The key of the HMAC on L2 records (--l2-mac), derived from the secret."""
    return _derive(secret, _L2_PERSON)


def curve_keys(secret: bytes, side: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 key pair of `side` ("server" or "client"), stable for a secret."""
    person = {"server": _SERVER_PERSON, "client": _CLIENT_PERSON}[side]
    sec = z85.encode(_derive(secret, person))
    return zmq.curve_public(sec), sec


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise AuthError("this libzmq was built without CURVE support; a secret cannot be used")


def curve_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` a CURVE server (call before bind). Clients are checked by the authenticator."""
    _require_curve()
    pub, sec = curve_keys(secret, "server")
    sock.curve_secretkey, sock.curve_publickey = sec, pub
    sock.curve_server = True


class _OneKey:
    """ZAP credentials provider: exactly one client public key is allowed."""

    def __init__(self, public: bytes):
        self.public = public  # z85, as pyzmq's authenticator hands keys to callback()

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(bytes(key), self.public)


def start_authenticator(ctx: zmq.Context, secret: bytes):
    """Start the ZAP handler that admits only the client key derived from `secret`.

    Start it BEFORE binding the CURVE socket: libzmq lets every CURVE client in when no ZAP
    handler is running. Returns the authenticator; call .stop() at shutdown."""
    from zmq.auth.thread import ThreadAuthenticator

    _require_curve()
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvedit.auth.zap"))
    auth.start()
    client_public = curve_keys(secret, "client")[0]
    auth.configure_curve_callback("*", credentials_provider=_OneKey(client_public))
    return auth


def curve_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` a CURVE client of the server derived from `secret` (call before connect)."""
    _require_curve()
    pub, sec = curve_keys(secret, "client")
    sock.curve_secretkey, sock.curve_publickey = sec, pub
    sock.curve_serverkey = curve_keys(secret, "server")[0]


# ---- data link handshake ---------------------------------------------------------------
def link_mac(secret: bytes | None, side: str, server_nonce: bytes, client_nonce: bytes,
             session: bytes, port: int) -> bytes:
    """HMAC-SHA256 of one side ("server" or "client") of the data-link handshake over both
    nonces, the session and the server's port; zeros without a secret. Each side's MAC is
    new per connection (two fresh nonces) and names its side, so neither can be replayed,
    nor one side's answer passed off as the other's."""
    if secret is None:
        return bytes(MAC_BYTES)
    person = {"server": _LINK_SERVER, "client": _LINK_CLIENT}[side]
    return hmac.new(secret, person + server_nonce + client_nonce + session
                    + port.to_bytes(2, "big"), hashlib.sha256).digest()


def _port(conn: socket.socket, peer: bool) -> int:
    """The server's TCP port of a data-link connection (0 for a socket pair)."""
    try:
        addr = conn.getpeername() if peer else conn.getsockname()
    except OSError:
        return 0
    return addr[1] if isinstance(addr, tuple) else 0


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = conn.recv_into(view[pos:])
        if not got:
            raise AuthError(f"peer closed the data connection during the handshake "
                            f"({pos} of {n} bytes)")
        pos += got
    return bytes(buf)


def server_handshake(conn: socket.socket, secret: bytes | None) -> bytes:
    """Send a nonce; read the client's nonce and session; prove the secret; read and check
    the client's MAC when a secret is set -> the session.

    Raises AuthError on a short answer or a wrong MAC (the caller sends its error reply and
    closes); socket timeouts (OSError) propagate, so set the first-bytes timeout before."""
    nonce = _secrets.token_bytes(NONCE_BYTES)
    conn.sendall(nonce)
    answer = _recv_exact(conn, NONCE_BYTES + SESSION_BYTES)
    theirs, session = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    port = _port(conn, peer=False)
    conn.sendall(link_mac(secret, "server", nonce, theirs, session, port))
    mac = _recv_exact(conn, MAC_BYTES)
    if secret is not None and not hmac.compare_digest(
            mac, link_mac(secret, "client", nonce, theirs, session, port)):
        raise AuthError("data link handshake failed: wrong or missing secret")
    return session


def client_handshake(conn: socket.socket, secret: bytes | None, session: bytes) -> None:
    """Send a nonce and `session` (16 bytes); with a secret, check the server's proof and
    only then send this side's MAC (AuthError, nothing sent, when the server cannot prove
    it has the secret)."""
    if len(session) != SESSION_BYTES:
        raise ValueError(f"session is {len(session)} bytes, expected {SESSION_BYTES}")
    nonce = _recv_exact(conn, NONCE_BYTES)
    mine = _secrets.token_bytes(NONCE_BYTES)
    conn.sendall(mine + session)
    proof = _recv_exact(conn, MAC_BYTES)
    port = _port(conn, peer=True)
    if secret is not None and not hmac.compare_digest(
            proof, link_mac(secret, "server", nonce, mine, session, port)):
        raise AuthError("the data link did not prove it knows this client's kvedit secret "
                        "(no secret, or another one): it is not the kvedit server the client "
                        "was told about (another process on the port?); nothing was sent")
    conn.sendall(link_mac(secret, "client", nonce, mine, session, port))


# ---- HTTP --------------------------------------------------------------------------------
# HTTP carries neither the secret nor anything a listener could take to another door: the
# bearer token is a key derived from the secret for HTTP alone (`http_token`), and a client
# sends it only after /health proved, on the same connection, that the server knows the
# secret and answers on the very address and port the client connected to (`http_proof`
# covers that endpoint). So a process squatting a port (a stopped server's, or [::1] where
# the real server listens on 127.0.0.1) that relays the challenge to a real server gets a
# proof for the wrong endpoint, and the client hangs up having sent nothing.
HTTP_AUTH = 2   # 1: the raw secret as bearer, proofs not bound to an endpoint; 2: this


def http_token(secret: bytes) -> str:
    """The HTTP bearer token of `secret` (64 hex digits): good for HTTP only; neither the
    secret nor the ZMQ, data-link or L2 keys can be computed from it."""
    return _derive(secret, _HTTP_TOKEN_PERSON).hex()


def http_authorized(authorization_header: str | None, secret: bytes | None) -> bool:
    """True when no secret is set, or the header is `Bearer <http_token(secret)>`
    (constant-time compare)."""
    if secret is None:
        return True
    token = _bearer(authorization_header)
    return token is not None and hmac.compare_digest(token, http_token(secret).encode())


def sent_raw_secret(authorization_header: str | None, secret: bytes | None) -> bool:
    """Whether the bearer token is the secret itself (a client from before HTTP_AUTH 2): it
    is refused, and told so."""
    token = _bearer(authorization_header)
    return secret is not None and token is not None and hmac.compare_digest(token, secret)


def _bearer(header: str | None) -> bytes | None:
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    try:
        return token.strip().encode("ascii")
    except UnicodeEncodeError:
        return None


def bearer_header(secret: bytes | None) -> dict[str, str]:
    """The HTTP header a client sends (empty without a secret): the derived token, never the
    secret. Send it only to a server that proved itself (kvedit.client.http_proof)."""
    return {} if secret is None else {"Authorization": f"Bearer {http_token(secret)}"}


def http_challenge() -> str:
    """A fresh challenge a client sends to /health (CHALLENGE_HEADER) before trusting it."""
    return _secrets.token_hex(NONCE_BYTES)


def endpoint(addr) -> str:
    """The endpoint of a socket address (a socket's getsockname/getpeername) as both sides
    name it: "127.0.0.1:8080", "[::1]:8080"; an IPv4-mapped IPv6 address as IPv4."""
    host, port = addr[0], int(addr[1])
    try:
        ip = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return f"{host}:{port}"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def http_proof(secret: bytes | None, challenge: str | None, where: str) -> str | None:
    """The server's answer to a /health challenge (PROOF_HEADER): an HMAC, keyed by a key
    derived from the secret, of the challenge and the endpoint `where` the server answers
    on (`endpoint` of its socket's own address); None without a secret or a well-formed
    challenge (16-128 hex digits)."""
    if secret is None or not challenge or not 16 <= len(challenge) <= 128:
        return None
    try:
        raw = bytes.fromhex(challenge)
    except ValueError:
        return None
    return hmac.new(_derive(secret, _HTTP_PROOF_PERSON), _HTTP_SERVER + raw + where.encode(),
                    hashlib.sha256).hexdigest()


def check_http_proof(secret: bytes, challenge: str, proof: str | None, where: str) -> bool:
    """Whether `proof` (the PROOF_HEADER of /health's answer) shows that a server knowing
    `secret` answered on endpoint `where` (the client's socket's peer address)."""
    want = http_proof(secret, challenge, where)
    return proof is not None and want is not None and hmac.compare_digest(proof.strip(), want)
