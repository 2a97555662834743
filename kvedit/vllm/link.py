"""The connector's connection to the kvedit server, kept usable across server outages.

vLLM must keep serving when the server is down: while it is, `client` is None (callers then
skip lookups and stores, so vLLM recomputes), one warning is logged per outage, and a
background thread reconnects when the server returns and re-runs the `on_connect` hook
(e.g. to register the model layout with the fresh server).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvedit.auth import SecretSource
from kvedit.client import KVClient, ServerUnavailable

logger = logging.getLogger("vllm.kvedit")  # under "vllm": lines land in vLLM's log

# What a dead or restarting server can raise out of a client call.
UNAVAILABLE = (ServerUnavailable, ConnectionError, TimeoutError, OSError)


class ServerLink:
    def __init__(self, url: str, timeout: float, retry_interval: float,
                 on_connect: Callable[[KVClient], None], role: str, *,
                 secret: bytes | SecretSource | None = None):
        """`secret`: the server's shared secret, or where to read it (read again at each
        reconnect: a server restarted with another secret is found again); None falls back
        to $KVEDIT_SECRET(_FILE), then a loopback server's own file."""
        self.url, self.timeout, self.retry_interval = url, timeout, retry_interval
        self._secret = secret
        self.on_connect, self.role = on_connect, role
        self.client: KVClient | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reconnector: threading.Thread | None = None
        self._last_error_log = -1e9
        if not self._try_connect():
            self._outage("not reachable at start-up")

    def _try_connect(self) -> bool:
        client = None
        try:
            # says hello: raises if down
            client = KVClient(self.url, timeout=self.timeout, secret=self._secret)
            self.on_connect(client)
        except BaseException as e:
            if client is not None:
                client.close()
            if isinstance(e, UNAVAILABLE):
                return False
            raise
        self.client = client
        return True

    def _outage(self, why: str) -> None:
        logger.warning("kvedit server %s unavailable (%s, %s side): vLLM keeps serving by "
                       "recomputing; will reconnect when it returns", self.url, why, self.role)
        self._reconnector = threading.Thread(target=self._reconnect, daemon=True,
                                             name="kvedit-reconnect")
        self._reconnector.start()

    def _reconnect(self) -> None:
        while not self._stop.wait(self.retry_interval):
            try:
                if self._try_connect():
                    logger.warning("kvedit server %s is back (%s side): loads and stores "
                                   "resume", self.url, self.role)
                    return
            except Exception as e:  # the server answered but refused us (e.g. a layout
                # conflict): say so, and keep trying, vLLM keeps serving meanwhile
                self.failed(e)

    def failed(self, err: BaseException) -> None:
        """A call on `client` raised: mark an outage (once) if it looks like one."""
        if not isinstance(err, UNAVAILABLE):  # the server answered with an error
            now = time.monotonic()
            if now - self._last_error_log > 30.0:  # a persistent error must not flood the log
                self._last_error_log = now
                logger.warning("kvedit %s call failed (KV not stored/loaded, vLLM "
                               "recomputes): %s", self.role, err)
            return
        with self._lock:
            if self.client is None:
                return  # outage already known; its reconnector is running
            old, self.client = self.client, None
        try:
            old.close()
        except Exception:  # a half-dead client may fail to close; it is dropped anyway
            pass
        self._outage(f"{type(err).__name__}: {err}")

    def close(self) -> None:
        self._stop.set()
        if self.client is not None:
            self.client.close()
            self.client = None
