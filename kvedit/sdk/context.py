"""connect() / close(): a Context binds one kvedit server, one model and its KV layout.

The context owns the KVClient (sockets, the shm mapping), a small thread pool that runs the
client's blocking calls off the event loop, and the reference counts of chunk keys across
its streams (so modify deletes only chunks no stream of this context still uses), and of
the captured-queries objects its streams asked for (kvedit.sdk.queries).

Tensor parallel (kvedit.sdk.tp): a model registered with tp_size n > 1 has one layout per
rank and each rank's chunks live under that rank's keys. `layout` is rank 0's (its keys are
the ones streams hold and reference-count), `tp` holds every rank's layout and the head
split; `keys_for` remembers the other ranks' keys of each rank-0 key so `delete_kv` deletes
a chunk on every rank. `layouts`, `fn_layout`, `rank_keys` and `split` answer the same
questions for one rank and for n, so modify has one path for both.

Nothing here changes the process beyond the context's own sockets, threads and mappings:
glibc's malloc is tuned only on request (`tune_glibc_heap=True`, kvedit.sdk.glibc_tuning).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from kvedit.auth import AuthError, SecretSource
from kvedit.client import KVClient, KVError
from kvedit.client.http_proof import NotProven, proven
from kvedit.keys import namespace, query_key, request_keys
from kvedit.layout import ModelLayout
from kvedit.sdk import glibc_tuning
from kvedit.sdk.buffers import BufferPool
from kvedit.sdk.errors import ConnectError
from kvedit.sdk.tp import TPRanks, scatter_ranks, tp_ranks

REGISTRATION_POLL_S = 0.2  # connect() waits for a model registration, an event with no push


class Context:
    """One server + model. Use `close()` (or `with`) to release sockets, mappings and threads."""

    def __init__(self, client, url: str, http_url: str | None, model: str,
                 layout: ModelLayout, *, io_threads: int = 32, track_writes: bool | None = None,
                 tp: TPRanks | None = None, fn_pool: glibc_tuning.FnPool | None = None):
        self.client = client
        self.url, self.http_url, self.model, self.layout = url, http_url, model, layout
        self.tp = tp   # None: one rank
        # Tensor parallel: rank-0 key -> the same chunk's keys on ranks 1.. (for delete_kv).
        self._rank_keys: dict[bytes, tuple[bytes, ...]] = {}
        self.refs: Counter[bytes] = Counter()
        self.query_refs: Counter[bytes] = Counter()   # captured-queries keys (sdk.queries)
        self.closed = False
        self._ids = itertools.count()
        # Touched retrieve buffers, reused across modifies; copy-on-write tracked (see buffers).
        self.pool = BufferPool(cow=track_writes)
        # Pages for the tensors fn builds with new_kv (kvedit.sdk.output), reused likewise.
        self.outputs = BufferPool(cow=False)
        self.fn_pool = fn_pool   # glibc_tuning's main-arena threads, only when asked for
        # Blocking client calls (some wait server-side for stores) run here, never on the loop.
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvedit-io")

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    def next_stream_id(self) -> int:
        return next(self._ids)

    @property
    def layouts(self) -> tuple[ModelLayout, ...]:
        """Every rank's layout (index = rank; one without tensor parallel)."""
        return (self.layout,) if self.tp is None else self.tp.layouts

    @property
    def fn_layout(self) -> ModelLayout:
        """The layout of the kv fn gets: every KV head (gathered under tensor parallel)."""
        return self.layout if self.tp is None else self.tp.layout

    def split(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """A kv laid out as fn_layout, cut per rank (index = rank; views, no copies)."""
        return [kv] if self.tp is None else scatter_ranks(kv, self.tp.heads)

    def columns(self) -> list[tuple[int, slice]]:
        """How a kv laid out as fn_layout is filled: (rank, the columns of its last dimension
        that rank's chunks hold), one rank per distinct head group."""
        if self.tp is None:
            return [(0, slice(None))]
        return [(r, self.tp.heads.columns(r)) for r in self.tp.heads.source_ranks()]

    async def call(self, fn, *args, **kwargs):
        """Run a blocking call (KVClient or CPU work) in the context's pool."""
        if self.closed:
            raise ConnectError(f"context for {self.model!r} at {self.url} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def run_fn(self, fn, *args, **kwargs):
        """Run a synchronous edit fn: in the context's pool, or glibc_tuning's fn pool when
        the context was connected with tune_glibc_heap=True."""
        if self.fn_pool is None:
            return await self.call(fn, *args, **kwargs)
        if self.closed:
            raise ConnectError(f"context for {self.model!r} at {self.url} is closed")
        return await glibc_tuning.run_fn(self.fn_pool, fn, *args, **kwargs)

    def rank_keys_for(self, tokens, salt: str) -> list[list[bytes]]:
        """The keys of `tokens`' full chunks on every rank (index = rank; one list without TP)."""
        return [request_keys(self.model, lay, tokens, salt) for lay in self.layouts]

    def rank_keys(self, keys: list[bytes], tokens, salt: str) -> list[list[bytes]]:
        """`keys` (rank 0's keys of `tokens`' full chunks under `salt`, as a stream holds
        them) and the same chunks' keys on the other ranks (index = rank), remembered for
        delete_kv. ValueError if `keys` are not rank 0's keys of those tokens."""
        if self.tp is None:
            return [list(keys)]
        per_rank = self.rank_keys_for(tokens, salt)
        if per_rank[0] != list(keys):
            raise ValueError("its keys are not rank 0's keys of its tokens (was it created "
                             "on another context?)")
        self.remember(per_rank)
        return per_rank

    def remember(self, per_rank: list[list[bytes]]) -> None:
        """Note the other ranks' keys of each rank-0 key (what delete_kv deletes with it)."""
        if len(per_rank) < 2:
            return
        for i, k in enumerate(per_rank[0]):
            self._rank_keys[k] = tuple(keys[i] for keys in per_rank[1:])

    def keys_for(self, tokens, salt: str) -> list[bytes]:
        """The keys of `tokens`' full chunks that streams hold: rank 0's under TP (the other
        ranks' are remembered for delete_kv)."""
        if self.tp is None:
            return request_keys(self.model, self.layout, tokens, salt)
        per_rank = self.rank_keys_for(tokens, salt)
        self.remember(per_rank)
        return per_rank[0]

    def query_keys_for(self, prompt, salt: str, window: int) -> list[bytes]:
        """The captured-queries key of `prompt` on every rank (index = rank); the other ranks'
        are remembered for delete_queries."""
        keys = [query_key(namespace(self.model, lay, salt), prompt, window)
                for lay in self.layouts]
        self.remember([[k] for k in keys])
        return keys

    def query_key_for(self, prompt, salt: str, window: int) -> bytes:
        """The captured-queries key of `prompt` that streams hold: rank 0's."""
        return self.query_keys_for(prompt, salt, window)[0]

    def delete_kv(self, keys: list[bytes]) -> int:
        """Delete chunks (streams' keys) from the server, on every rank under TP -> how many
        rank-0 chunks were deleted. A rank-0 key whose other ranks' keys were never computed
        through this context (keys_for, modify) is deleted on rank 0 only; the other ranks'
        copies then stay until the server evicts them."""
        return self._delete(self.client.delete, keys)

    def delete_queries(self, keys: list[bytes]) -> int:
        """Delete captured-queries objects, on every rank whose key is known (as delete_kv)."""
        return self._delete(self.client.delete_queries, keys)

    def _delete(self, delete, keys: list[bytes]) -> int:
        n = delete(self.model, keys)
        if self.tp is not None:
            others = [self._rank_keys.pop(k) for k in keys if k in self._rank_keys]
            for r in range(1, self.tp.size):
                if others:
                    delete(self.model, [o[r - 1] for o in others], tp_rank=r)
        return n

    def ref(self, keys) -> None:
        self.refs.update(keys)

    def unref(self, keys) -> list[bytes]:
        """Drop one reference per key; returns the keys nothing references any more."""
        dead = []
        for k in keys:
            self.refs[k] -= 1
            if self.refs[k] <= 0:
                del self.refs[k]
                dead.append(k)
        return dead

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.pool.clear()
        self.outputs.clear()
        self.client.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        tp = f", tp_size={self.tp.size}" if self.tp is not None else ""
        return f"Context(model={self.model!r}, url={self.url!r}, layout={self.layout}{tp})"


def connect(url: str = "tcp://127.0.0.1:6555", http_url: str | None = None,
            model_name: str = "", timeout: float = 60.0, *, use_shm: bool | None = None,
            io_threads: int = 32, track_writes: bool | None = None,
            secret: str | bytes | None = None, secret_file: str | None = None,
            total_kv_heads: int | None = None, tune_glibc_heap: bool = False,
            keep_freed_memory: bool | None = None) -> Context:
    """Connect to the kvedit server at `url` and read `model_name`'s layout.

    If the model is not registered yet, wait up to `timeout` seconds for the vLLM connector to
    register it, then fail with the list of models the server has. `http_url` (the server's
    HTTP port) is checked too when given. Errors arrive within `timeout`.

    `track_writes` (None: where the OS allows it) hands fn its tensor through a copy-on-write
    mapping so modify need not byte-compare chunks fn left untouched (kvedit.sdk.buffers):
    faster for edits that read kv and return it or a new tensor, slower (a page copy per
    written page) for edits that rewrite much of kv in place; False turns it off.

    `tune_glibc_heap` (default False): tune glibc's malloc for the whole process so an fn
    that allocates a large output itself (torch.cat) reuses touched pages (kvedit.sdk.
    glibc_tuning: mallopt, one malloc arena, fn run in threads on the main arena). It
    changes every thread's malloc and keeps the process's peak heap: only ask for it in a
    process that runs nothing else. An fn can instead build its output with the `new_kv`
    keyword (kvedit.sdk.output), which needs no tuning. `keep_freed_memory=True` is the
    older name of tune_glibc_heap=True (deprecated).

    Tensor parallel (the connector registered tp_size n > 1): connect reads every rank's
    layout (waiting for all n within `timeout`) and modify gathers the ranks' heads for fn
    (kvedit.sdk.tp). That needs the model's total KV head count: the connector registers it;
    `total_kv_heads` gives it for layouts from older connectors (and is checked against
    the layouts when both say it).

    `secret` / `secret_file`: the server's shared secret (kvedit.auth); by default
    $KVEDIT_SECRET or $KVEDIT_SECRET_FILE when set, else the secret a loopback server of this
    user made at start (kvedit.rundir), read again if the server restarts with another. Used
    for ZMQ (CURVE) and the data link, each of which has the server prove it knows the
    secret before this process sends anything derived from it; `http_url`'s /health must
    prove it too (the SDK sends no bearer token: /health needs none).
    """
    if not model_name:
        raise ConnectError("connect() needs model_name: the served model name vLLM uses")
    if keep_freed_memory:
        warnings.warn("connect(keep_freed_memory=True) is now tune_glibc_heap=True (off by "
                      "default; docs/sdk.md, Allocator)", DeprecationWarning, stacklevel=2)
        tune_glibc_heap = True
    deadline = time.monotonic() + timeout
    try:
        source = SecretSource(secret, secret_file, url=url)
        key = source.read()
    except AuthError as e:
        raise ConnectError(str(e)) from None
    if http_url:
        _check_health(http_url, key, min(5.0, timeout))
    try:
        client = KVClient(url, use_shm=use_shm, timeout=max(0.5, min(10.0, timeout)),
                          secret=source)
    except KVError as e:
        raise ConnectError(f"cannot reach the kvedit server at {url}: {e.message}; is "
                           f"`kvedit server` running there?") from None
    try:
        layout = _wait_for_layout(client, model_name, deadline)
        if layout is None:
            models = sorted(client.list_models())
            raise ConnectError(f"model {model_name!r} is not registered with the kvedit server "
                               f"at {url} after {timeout:.0f} s; it has: {models or 'no models'}"
                               f". Is vLLM running with the kvedit connector and serving this "
                               f"name (--served-model-name)?")
        tp = _tensor_parallel(client, model_name, layout, total_kv_heads, deadline, url)
    except KVError as e:
        client.close()
        raise ConnectError(f"the kvedit server at {url} failed while connecting: {e}") from None
    except BaseException:
        client.close()
        raise
    pool = glibc_tuning.enable() if tune_glibc_heap else None
    return Context(client, url, http_url, model_name, layout, io_threads=io_threads,
                   track_writes=track_writes, tp=tp, fn_pool=pool)


def _check_health(http_url: str, key: bytes | None, timeout: float) -> None:
    """/health answers, and (with a secret) proves it knows the secret on the endpoint this
    process reached (kvedit.client.http_proof): a process squatting the HTTP port while the
    server restarts, or relaying another server's proof, is refused (it gets no token
    either way: the SDK sends none)."""
    try:
        conn, _ = proven(http_url, key, timeout=timeout)
    except NotProven as e:
        raise ConnectError(str(e)) from None
    except (OSError, ValueError) as e:
        raise ConnectError(f"the kvedit server's HTTP endpoint {http_url} does not answer "
                           f"/health ({type(e).__name__}: {e}); is `kvedit server` running "
                           f"with that --http-port?") from None
    conn.close()


def _tensor_parallel(client, model: str, layout: ModelLayout, total_kv_heads: int | None,
                     deadline: float, url: str) -> TPRanks | None:
    """None for one rank; else every rank's layout and the head split, or ConnectError
    saying why the ranks' heads cannot be gathered."""
    if layout.tp_size == 1:
        if total_kv_heads is not None and total_kv_heads != layout.num_kv_heads:
            raise ConnectError(f"connect(total_kv_heads={total_kv_heads}) but model {model!r} "
                               f"is registered with one rank of {layout.num_kv_heads} KV heads")
        return None
    layouts = [layout]
    for r in range(1, layout.tp_size):
        lay = _wait_for_layout(client, model, deadline, r)
        if lay is None:
            raise ConnectError(f"model {model!r} is registered with tp_size={layout.tp_size} "
                               f"but rank {r} never registered its layout with the kvedit "
                               f"server at {url}; the SDK edits a tensor-parallel model only "
                               f"with every rank's chunks (is every vLLM worker running the "
                               f"kvedit connector?)")
        layouts.append(lay)
    try:
        return tp_ranks(layouts, total_kv_heads)
    except ValueError as e:
        raise ConnectError(f"model {model!r} (tp_size={layout.tp_size}): the SDK cannot "
                           f"gather its ranks' KV heads: {e}") from None


def _wait_for_layout(client, model: str, deadline: float,
                     tp_rank: int = 0) -> ModelLayout | None:
    while True:
        layout = client.get_layout(model, tp_rank)
        if layout is not None or time.monotonic() >= deadline:
            return layout
        time.sleep(min(REGISTRATION_POLL_S, max(0.0, deadline - time.monotonic())))


def close(ctx: Context) -> None:
    """Release every socket, mapping and thread the context holds (idempotent)."""
    ctx.close()


async def aconnect(*args, **kwargs) -> Context:
    """connect() without blocking the running event loop."""
    return await asyncio.to_thread(connect, *args, **kwargs)


async def aclose(ctx: Context) -> None:
    await asyncio.to_thread(ctx.close)
