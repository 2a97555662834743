"""What an --l2-url names: one Redis (or Valkey), a Unix socket, or a Redis/Valkey Cluster,
with its TLS and AUTH/ACL options. One parser for the config check, the tier and the logs, so
the spellings a user may write are accepted (or refused with the reason) in one place:

    redis://[user:pass@]host[:port][/db]       rediss:// (TLS)     unix://path
    valkey://...  valkeys://...                 (the same, as Valkey users write them)
    redis+cluster://[user:pass@]h1:p1,h2:p2,...[?options]   rediss+cluster://  (TLS)
    valkey+cluster://...  valkeys+cluster://...

A cluster URL lists startup nodes (any one that answers is enough to find the rest); it has
no database (a cluster has only db 0). Query options (`ssl_cert_reqs`, `ssl_ca_certs`, ...)
are redis-py's and are passed through to every node's connection.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

DEFAULT_PORT = 6379
# scheme -> (cluster, tls)
SCHEMES = {"redis": (False, False), "rediss": (False, True), "unix": (False, False),
           "valkey": (False, False), "valkeys": (False, True),
           "redis+cluster": (True, False), "rediss+cluster": (True, True),
           "valkey+cluster": (True, False), "valkeys+cluster": (True, True)}


@dataclass(frozen=True, slots=True)
class L2Target:
    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]   # (host, port) startup nodes; empty for unix://
    username: str | None
    password: str | None
    options: tuple[tuple[str, str], ...]   # the query string's options, for every node
    single_url: str                        # a redis-py URL for one node (not a cluster)


def parse(url: str) -> L2Target:
    """Parse an --l2-url, or raise ValueError naming what is wrong and what is expected."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"--l2-url {redacted(url)!r} must start with one of "
                         f"{[s + '://' for s in SCHEMES]}")
    cluster, tls = SCHEMES[scheme]
    if not cluster:
        # redis-py reads redis://, rediss:// and unix:// itself; valkey spellings map onto them
        base = {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme)
        single = f"{base}://{rest}"
        u = urlsplit(single)
        try:
            nodes = () if base == "unix" else ((u.hostname or "localhost", u.port or DEFAULT_PORT),)
        except ValueError as e:   # a port that is not a number
            raise ValueError(f"--l2-url {redacted(url)!r}: {e}") from None
        return L2Target(False, tls, nodes, _unq(u.username), _unq(u.password),
                        tuple(parse_qsl(u.query)), single)
    rest, _, query = rest.partition("?")
    netloc, _, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo = ""
    user, colon, password = userinfo.partition(":")
    if tail not in ("", "0"):
        raise ValueError(f"--l2-url {redacted(url)!r}: a cluster has only database 0, got "
                         f"/{tail}; drop the path")
    nodes = tuple(_host_port(h, url) for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError(f"--l2-url {redacted(url)!r} names no node: give at least one "
                         f"host:port of the cluster ({scheme}://h1:p1,h2:p2,...)")
    return L2Target(True, tls, nodes, _unq(user) if user else None,
                    _unq(password) if colon else None, tuple(parse_qsl(query)), "")


def _host_port(h: str, url: str) -> tuple[str, int]:
    try:
        u = urlsplit("//" + h)
        port = u.port
    except ValueError:
        port = -1
    if port == -1 or not u.hostname:
        raise ValueError(f"--l2-url {redacted(url)!r}: {h!r} is not host or host:port "
                         f"(port 1..65535)")
    return u.hostname, port or DEFAULT_PORT


def _unq(s: str | None) -> str | None:
    return unquote(s) if s else None


def redacted(url: str) -> str:
    """The URL without its password (for /config, /status and logs); works for the
    comma-separated host lists of cluster URLs, which urllib's parser refuses."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{tail}"


def node_name(host: str, port: int) -> str:
    return f"{host}:{port}"
