"""Start a throwaway Redis Cluster on loopback: masters with a replica each, made of the same
redis-server that `RedisProcess` runs (tests, `kvedit bench l2 --cluster`, the two-engine
example). A module of its own because a cluster is more than N servers: it is created with
`redis-cli --cluster create`, its topology moves (a replica is promoted when a master dies),
and a test needs to find the node that holds a key or replaced a master.

Each node has its own cluster-bus port (`--cluster-port`, Redis 7+) rather than port + 10000,
which may lie above 65535 for a free ephemeral port. Persistence is off, as for one Redis: a
node restarted after a kill comes back empty and rejoins as a replica (its nodes.conf, kept in
the cluster's directory, says which cluster it belongs to) and resyncs from its master.
Stopped node by node by PID; the directory is removed at the end.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvedit.launch.redis import INSTALL_HINT, RedisProcess, redis_server_path
from kvedit.launch.server import free_port

SLOTS = 16384


@dataclass(frozen=True, slots=True)
class NodeState:
    """One line of CLUSTER NODES, as seen by a live node."""
    port: int
    role: str                  # "master" | "replica"
    master_port: int | None    # a replica's master
    failed: bool               # flagged fail / pfail, or disconnected
    slots: int                 # how many hash slots it serves (masters)


class RedisClusterProcess:
    """`masters` masters with `replicas` replicas each, all on 127.0.0.1. `.url` is the
    `redis+cluster://` URL kvedit takes (every node is a startup node, so discovery works while
    any one answers); `.nodes` the RedisProcess of each node (kill, pause, resume, start)."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 2000,
                 maxmemory_mb: int = 0, password: str | None = None,
                 startup_timeout: float = 60.0):
        if redis_server_path() is None or shutil.which("redis-cli") is None:
            raise RuntimeError(INSTALL_HINT + " (a cluster needs redis-cli too)")
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="kvedit-redis-cluster-"))
        self.nodes: list[RedisProcess] = []
        try:
            for _ in range(masters * (1 + replicas)):
                port = free_port()
                opts = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(node_timeout_ms),
                        "--cluster-port", str(free_port()))
                if password:   # replicas authenticate to their master
                    opts += ("--masterauth", password)
                self.nodes.append(RedisProcess(port, maxmemory_mb, password=password,
                                               extra_args=opts, workdir=self.dir))
            self._create(replicas, startup_timeout)
            self.wait_ok(startup_timeout)
        except BaseException:
            self.stop()
            raise
        auth = f":{password}@" if password else ""
        self.url = "redis+cluster://" + auth + ",".join(f"127.0.0.1:{n.port}"
                                                         for n in self.nodes)

    def _create(self, replicas: int, timeout: float) -> None:
        cmd = ["redis-cli", "--cluster", "create",
               *[f"127.0.0.1:{n.port}" for n in self.nodes],
               "--cluster-replicas", str(replicas), "--cluster-yes"]
        if self.password:
            cmd[1:1] = ["-a", self.password, "--no-auth-warning"]
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
        if p.returncode != 0 or "[OK] All 16384 slots covered" not in p.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed ({p.returncode}): "
                               f"{(p.stdout + p.stderr)[-2000:]}")

    # ---- topology ------------------------------------------------------------------------
    def _client(self, port: int):
        import redis
        return redis.Redis(port=port, password=self.password, socket_timeout=1,
                           socket_connect_timeout=1)

    def live(self) -> list[RedisProcess]:
        """Nodes running (not killed); a paused one counts as running."""
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def node(self, port: int) -> RedisProcess:
        return next(n for n in self.nodes if n.port == port)

    def topology(self, via: RedisProcess | None = None) -> list[NodeState]:
        """CLUSTER NODES as one live node sees it (the first that answers, or `via`)."""
        import redis
        for n in ([via] if via else self.live()):
            c = self._client(n.port)
            try:
                raw = c.execute_command("CLUSTER", "NODES")
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            finally:
                c.close()
            return _parse_nodes(raw.decode() if isinstance(raw, bytes) else raw)
        raise RuntimeError("no node of the cluster answers CLUSTER NODES")

    def masters(self) -> list[RedisProcess]:
        """The masters serving slots now (a failed one is left out)."""
        return [self.node(s.port) for s in self.topology()
                if s.role == "master" and s.slots and not s.failed]

    def master_of(self, key: bytes) -> RedisProcess:
        """The master serving `key`'s hash slot now."""
        import redis
        from redis.crc import key_slot
        slot = key_slot(key)
        for n in self.live():
            c = self._client(n.port)
            try:
                ranges = c.execute_command("CLUSTER", "SLOTS")
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            finally:
                c.close()
            return next(self.node(int(r[2][1])) for r in ranges if r[0] <= slot <= r[1])
        raise RuntimeError("no node of the cluster answers CLUSTER SLOTS")

    def replica_of(self, master: RedisProcess) -> RedisProcess:
        return next(self.node(s.port) for s in self.topology()
                    if s.role == "replica" and s.master_port == master.port)

    def wait_ok(self, timeout: float = 30.0, without: RedisProcess | None = None) -> float:
        """Until every running node (but `without`) says cluster_state:ok, sees all slots
        covered by masters none of which failed and every other node it does not see failed as
        a replica, and (a replica) has synced with its master -> the time it took."""
        t0 = time.monotonic()
        while True:
            if self._ok(without):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the Redis cluster did not become ok within {timeout} s: "
                                   f"{self.topology()}")
            time.sleep(0.05)

    def wait_replaced(self, master: RedisProcess, timeout: float = 30.0) -> float:
        """Until the other nodes have promoted a replica in place of `master` (killed or
        paused) and the cluster is ok without it -> the time it took."""
        t0 = time.monotonic()
        while True:
            others = [n for n in self.live() if n is not master]
            try:
                serving = {s.port for s in self.topology(via=others[0])
                           if s.role == "master" and s.slots and not s.failed}
            except RuntimeError:
                serving = {master.port}
            if master.port not in serving and self._ok(without=master):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no replica replaced the master on port {master.port} "
                                   f"within {timeout} s: {self.topology(via=others[0])}")
            time.sleep(0.05)

    def _ok(self, without: RedisProcess | None) -> bool:
        import redis
        for n in self.live():
            if n is without:
                continue
            c = self._client(n.port)
            try:
                if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
                states = _parse_nodes(c.execute_command("CLUSTER", "NODES").decode())
                repl = c.info("replication")
            except (redis.ConnectionError, redis.TimeoutError):
                return False
            finally:
                c.close()
            masters = [s for s in states if s.role == "master" and s.slots]
            if sum(s.slots for s in masters) != SLOTS or any(s.failed for s in masters):
                return False
            if any(s.role == "master" and not s.slots and not s.failed for s in states):
                return False           # not yet attached to its master
            if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                return False
        return True

    def keys_per_master(self) -> dict[int, int]:
        """{port: DBSIZE} of each serving master."""
        out = {}
        for m in self.masters():
            c = self._client(m.port)
            try:
                out[m.port] = c.dbsize()
            finally:
                c.close()
        return out

    def flushall(self) -> None:
        for m in self.masters():
            c = self._client(m.port)
            try:
                c.flushall()
            finally:
                c.close()

    # ---- life ----------------------------------------------------------------------------
    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _parse_nodes(text: str) -> list[NodeState]:
    """CLUSTER NODES lines: id addr flags master ping pong epoch link slot...; the rest
    (node ids) only resolves a replica's master to its port."""
    rows = [line.split() for line in text.splitlines() if line.strip()]
    port_of = {r[0]: int(r[1].split("@")[0].rsplit(":", 1)[1]) for r in rows}
    out = []
    for r in rows:
        flags = r[2].split(",")
        slots = 0
        for part in r[8:]:
            if part.startswith("["):       # a slot being imported/migrated
                continue
            lo, _, hi = part.partition("-")
            slots += int(hi or lo) - int(lo) + 1
        out.append(NodeState(port=port_of[r[0]],
                             role="master" if "master" in flags else "replica",
                             master_port=port_of.get(r[3]),
                             failed=bool({"fail", "fail?", "noaddr"} & set(flags))
                             or r[7] != "connected",
                             slots=slots))
    return out
