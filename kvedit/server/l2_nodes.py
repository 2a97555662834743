"""Where a chunk's Redis keys live: the one Redis of a redis:// URL, or the master serving
their hash slot in a Redis/Valkey Cluster. One small interface for both, chosen once from the
URL (`open_nodes`), so the record code (l2_redis.py) is written once and a single Redis is
simply the node that serves every slot.

The cluster's topology (slot map, nodes, their connection pools, MOVED patches, refreshes) is
redis-py's `RedisCluster`; only the bytes of a chunk bypass its command path (see
l2_redis.py). The map is shared by the tier's threads: each operation checks a connection of
its own out of the node's pool, as a single Redis's pool is shared today.

A node that does not answer becomes a `NodeError` naming it, so the tier can say which node is
down and since when; a node that says it cannot serve now (CLUSTERDOWN, LOADING) counts the
same way. `check()` is the writer's probe while the tier is down: for a cluster it
refreshes the slot map (asking the node that failed last) and PINGs every master, so the tier
comes back once a replica has been promoted in place of a dead master.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import quote, urlencode

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.crc import key_slot
from redis.exceptions import (AskError, BusyLoadingError, ClusterDownError, MovedError,
                              RedisClusterException)
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvedit.server.l2_url import L2Target, node_name

# Redis down or slow; and what a node answers while it cannot serve a slot at all (TRYAGAIN,
# a multi-key command in a slot being migrated, is not that: l2_redis.py waits it out)
ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
UNAVAILABLE = (ClusterDownError, BusyLoadingError)


class NodeError(redis.ConnectionError):
    """A node did not answer (refused, timed out, closed mid-reply) or the cluster could not
    serve its slots: `node` names it ("host:port", or "cluster" before any node answered)."""

    def __init__(self, node: str, cause: BaseException):
        super().__init__(f"{node}: {type(cause).__name__}: {str(cause)[:200]}")
        self.node = node


@dataclass(frozen=True, slots=True)
class Route:
    node: str                      # "host:port"
    pool: redis.ConnectionPool
    asking: bool = False           # an ASK redirect: send ASKING before the command


class OneRedis:
    """The single Redis (or Valkey) of a redis://, rediss:// or unix:// URL."""
    cluster = False
    retry_max_s = 5.0   # a lone Redis comes back by a restart: no hurry to ask again

    def __init__(self, target: L2Target, timeout: float):
        # connects at first use, so a server starts while Redis is down
        self.pool = redis.ConnectionPool.from_url(target.single_url, socket_timeout=timeout,
                                                  socket_connect_timeout=timeout)
        self.name = (node_name(*target.nodes[0]) if target.nodes
                     else self.pool.connection_kwargs.get("path", "unix socket"))
        self._route = Route(self.name, self.pool)

    def route(self, rkey: bytes) -> Route:
        return self._route

    def groups(self, rkeys: list[bytes]) -> list[tuple[Route, list[list[int]]]]:
        return [(self._route, [list(range(len(rkeys)))])]

    def redirected(self, e: AskError) -> Route:
        raise redis.ResponseError(f"the L2 Redis at {self.name} answered {e}: it is a cluster "
                                  f"node; give a redis+cluster:// URL")

    def check(self, failed: str | None = None) -> None:
        try:
            redis.Redis(connection_pool=self.pool).ping()
        except ERRORS as e:
            raise NodeError(self.name, e) from e

    def masters(self) -> list[str]:
        return [self.name]

    def close(self) -> None:
        self.pool.disconnect()


class ClusterNodes:
    """The masters of a Redis/Valkey Cluster, found from the URL's startup nodes."""
    cluster = True
    retry_max_s = 1.0   # a failover takes about the node timeout: look again soon

    def __init__(self, target: L2Target, timeout: float):
        self.target = target
        kw = {k: v for k, v in _node_kwargs(target).items()
              if k not in ("host", "port", "db", "connection_class")}
        self._kw = kw | {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                         "ssl": target.tls}
        self._rc: RedisCluster | None = None
        self._building = threading.Lock()   # one thread builds; readers of _rc never wait

    def _cluster(self) -> RedisCluster:
        """The client, made at first use (its constructor reads the topology: a server
        starts while the cluster is down, and keeps asking)."""
        rc = self._rc
        if rc is not None:
            return rc
        with self._building:
            if self._rc is None:
                try:
                    self._rc = RedisCluster(
                        startup_nodes=[ClusterNode(h, p) for h, p in self.target.nodes],
                        retry=Retry(NoBackoff(), 0), **self._kw)
                except (RedisClusterException, redis.RedisError, OSError) as e:
                    raise NodeError("cluster", e) from e
            return self._rc

    def route(self, rkey: bytes) -> Route:
        rc = self._cluster()
        try:
            node = rc.nodes_manager.get_node_from_slot(key_slot(rkey))
        except RedisClusterException as e:   # the slot is not covered (a master lost)
            raise NodeError("cluster", e) from e
        return Route(node.name, rc.get_redis_connection(node).connection_pool)

    def groups(self, rkeys: list[bytes]) -> list[tuple[Route, list[list[int]]]]:
        """The keys' indices by node, then by slot (one MGET per slot)."""
        by_node: dict[str, tuple[Route, dict[int, list[int]]]] = {}
        for i, k in enumerate(rkeys):
            r = self.route(k)
            by_node.setdefault(r.node, (r, {}))[1].setdefault(key_slot(k), []).append(i)
        return [(r, list(slots.values())) for r, slots in by_node.values()]

    def redirected(self, e: AskError) -> Route:
        """Where a MOVED (the slot map is patched) or an ASK (this once) sends a command."""
        rc = self._cluster()
        if isinstance(e, MovedError):
            rc.nodes_manager.move_slot(e)
        node = rc.nodes_manager.get_node(e.host, e.port)
        if node is None:   # a node the map does not know yet: the next check() learns it
            raise NodeError(node_name(e.host, e.port), e)
        return Route(node.name, rc.get_redis_connection(node).connection_pool,
                     asking=not isinstance(e, MovedError))

    def check(self, failed: str | None = None) -> None:
        """Refresh the slot map (the node that `failed` last is asked last), then PING every
        master: raises NodeError for the first that does not answer."""
        rc = self._cluster()
        try:
            rc.nodes_manager.initialize(last_failed_node_name=failed)
        except (RedisClusterException, redis.RedisError, OSError) as e:
            raise NodeError("cluster", e) from e
        for node in rc.get_primaries():
            try:
                rc.get_redis_connection(node).ping()
            except ERRORS + UNAVAILABLE as e:
                raise NodeError(node.name, e) from e

    def masters(self) -> list[str]:
        rc = self._rc   # the HTTP thread asks: never wait for a build or a refresh
        return sorted(n.name for n in rc.get_primaries()) if rc is not None else []

    def close(self) -> None:
        rc, self._rc = self._rc, None
        if rc is not None:
            rc.close()


def _node_kwargs(target: L2Target) -> dict:
    """redis-py's connection options from the URL's user, password and query (typed as
    redis-py types them), for every node of a cluster."""
    auth = ""
    if target.username or target.password:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    return parse_url(f"redis://{auth}localhost/?{urlencode(target.options)}")


def open_nodes(target: L2Target, timeout: float) -> OneRedis | ClusterNodes:
    return ClusterNodes(target, timeout) if target.cluster else OneRedis(target, timeout)
