"""The per-user runtime directory: where a server started without a secret leaves the one it
made, for clients of the same user (the token file of Jupyter's and Ray's servers).

Why: a server open to every local user lets any of them read, poison and wipe every tenant's
KV over loopback. With no --secret-file the server makes a secret at start and writes it
here, mode 0600 in a 0700 directory of its user; a KVClient (connector, SDK, tools) given no
secret reads the file of the server's port. Another user cannot read it, so its client gets
no reply (CURVE), `unauthorized` (data link) and 401 (HTTP).

Where: $XDG_RUNTIME_DIR/kvedit when $XDG_RUNTIME_DIR is a private directory of this user,
else /tmp/kvedit-<uid>. A directory that is not this user's, or that others may enter, is
never used (another user may have made it to read or plant secrets): `publish` refuses
(the server then stops and says why) and `lookup` finds nothing there. A client looks in
every place a server of its user may have written (its own $XDG_RUNTIME_DIR, the usual
/run/user/<uid>, /tmp/kvedit-<uid>): a server started from a login shell and a client run by
cron or a service see different environments. So that a stale file elsewhere does not win,
a server removes the files of its port from all the places it knows before writing its own,
and a client takes the newest file of the port it finds.
One file per ZMQ port, `<port>.secret` (the secret and a newline, as --gen-secret writes
one, so it also works as --secret-file). It outlives its server: the next server started
without a secret on that port reuses it (`reusable`: a regular file of this user, mode 0600,
in the private directory), so clients keep working across a restart and L2 records signed
with it (--l2-mac) stay valid. Remove the file to make the next server draw a new secret.
Only loopback URLs are looked up: a file here never belongs to a server on another host.
No kvedit imports: kvedit.auth (client and server) uses it.
"""
from __future__ import annotations

import ipaddress
import os
import pwd
import stat
import tempfile
from pathlib import Path

SUFFIX = ".secret"


class RundirError(OSError):
    """The runtime directory cannot be made private; the message says where and why."""


def directory() -> Path:
    """The runtime directory to use (it may not exist yet)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and _private(Path(xdg)):
        return Path(xdg) / "kvedit"
    return Path(tempfile.gettempdir()) / f"kvedit-{os.getuid()}"


def secret_path(port: int) -> Path:
    return directory() / f"{int(port)}{SUFFIX}"


def candidates() -> list[Path]:
    """Every directory a server of this user may have written to, the usual one first."""
    out = [directory(), Path(f"/run/user/{os.getuid()}") / "kvedit",
           Path(tempfile.gettempdir()) / f"kvedit-{os.getuid()}"]
    return list(dict.fromkeys(out))


def ensure() -> Path:
    """The directory, created (0700) if missing; RundirError if it is not private."""
    d = directory()
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RundirError(f"cannot create the kvedit runtime directory {d}: {e.strerror}"
                          ) from None
    if not _private(d):
        raise RundirError(_why_not_private(d))
    return d


def reusable(port: int) -> tuple[Path | None, str]:
    """(the file an earlier server on `port` left in this user's directory, "") when it may
    be reused: a regular file (not a link) of this user with mode 0600; else (None, why)."""
    d = directory()
    path = d / f"{int(port)}{SUFFIX}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, f"no secret of an earlier server on port {port} in {d}"
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror}"
    if not _private(d):
        return None, _why_not_private(d)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return None, f"{path} is not a regular file of this user"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return None, f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 600"
    return path, ""


def publish(port: int, secret: bytes) -> Path:
    """Write the secret of the server on `port` (0600, atomically) -> its path; files of the
    port elsewhere (earlier servers') go. RundirError when the directory is not private to
    this user."""
    d = ensure()
    withdraw(port)
    path = d / f"{int(port)}{SUFFIX}"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{port}-")   # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def withdraw(port: int, secret: bytes | None = None) -> None:
    """Remove the files of `port` (only one holding `secret`, when given): a server stopping,
    or one starting with another secret (or none) on a port an earlier one left a file for."""
    for d in candidates():
        path = d / f"{int(port)}{SUFFIX}"
        try:
            if not _private(d) or (secret is not None and path.read_bytes().strip() != secret):
                continue
            path.unlink()
        except OSError:
            pass


def lookup(url: str) -> tuple[bytes, Path] | None:
    """(secret, path) for a loopback server URL (tcp://127.0.0.1:6555) whose server left a
    file here; None otherwise."""
    host, port = _host_port(url)
    if port is None or not _is_loopback(host):
        return None
    found = []
    for d in candidates():
        path = d / f"{port}{SUFFIX}"
        try:
            if not _private(d):
                continue
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            data = path.read_bytes().strip()
        except OSError:
            continue
        if data:
            found.append((st.st_mtime_ns, data, path))
    if not found:
        return None
    _, data, path = max(found)   # the newest: a live server's, not one an earlier one left
    return data, path


def secrets_here(limit: int = 64) -> list[bytes]:
    """The secrets of this user's servers left here (newest first, at most `limit`): an HTTP
    client that knows only a server's HTTP URL finds which one it is by the server's proof
    (kvedit.client.http_proof), sending nothing derived from any."""
    found = []
    for d in candidates():
        if not _private(d):
            continue
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False) and \
                        e.stat(follow_symlinks=False).st_uid == os.getuid():
                    found.append((e.stat(follow_symlinks=False).st_mtime_ns,
                                  Path(e.path).read_bytes().strip()))
            except OSError:
                continue
    found.sort(reverse=True)
    return list(dict.fromkeys(data for _, data in found if data))[:limit]


# ---- internals -----------------------------------------------------------------------------
def _why_not_private(d: Path) -> str:
    """What is wrong with runtime directory `d` and what to do: named owner and mode."""
    try:
        st = os.lstat(d)
    except OSError as e:
        return f"the kvedit runtime directory {d} cannot be used: {e.strerror}"
    try:
        owner = f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except KeyError:
        owner = f"uid {st.st_uid}"
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
    me = f"{_user()} (uid {os.getuid()})"
    return (f"the kvedit runtime directory {d} is {kind} owned by {owner} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}; it must be a directory of {me} with mode 0700, "
            f"or another user could read or plant this server's secret. Remove it (its "
            f"owner or root: rm -r {d}), or set XDG_RUNTIME_DIR to a private directory of "
            f"yours, or give the server --secret-file PATH (or --insecure)")


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


def _private(d: Path) -> bool:
    """A real directory (not a link) of this user that nobody else may enter."""
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def _host_port(url: str) -> tuple[str, int | None]:
    rest = url.rsplit("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return rest, None
    return host.strip("[]"), int(port)


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    return _is_loopback(host)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
