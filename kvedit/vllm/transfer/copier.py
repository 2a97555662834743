"""PagedCopier: the copies between the server's chunks and vLLM's paged blocks for one rank.

WorkerSide (worker_side.py) owns one per rank and calls load_run before the forward and
store_chunks after it. On the CPU a store copies from the paged blocks straight into the
server's shared-memory slots; on a GPU it gathers into device staging (gpu_memory.py) and
copies to the host in pieces that overlap the gathers, then commits in vLLM's step (or, with
the connector setting async_store, from a background thread). `kvedit bench connector
--paged` times this same code.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvedit.layout import ModelLayout
from kvedit.vllm.paged import PagedKV
from kvedit.vllm.transfer.copier_stats import LoadStats, LoadTiming, StoreStats
from kvedit.vllm.transfer.gpu_memory import (
    DeviceStreams,
    HostMapping,
    StagingRing,
    default_staging_bytes,
)
from kvedit.vllm.transfer.plan import ChunkRun

logger = logging.getLogger("vllm.kvedit")


@dataclass
class _StoreJob:
    """Chunks gathered into staging slots [start, start + len(keys)), waiting to be copied
    to the server and committed."""
    client: object
    keys: list[bytes]
    start: int
    gathered: object = None  # CUDA event after the gather, on the forward's stream


class PagedCopier:
    """The copies between the server's chunks and vLLM's paged blocks for one rank: what a
    load and a store do per chunk. WorkerSide owns one; `kvedit bench connector --paged`
    times this same code, so the benchmark measures the connector's real path.

    On a GPU ("staged"), a store gathers a batch of chunks into a device staging ring with
    one op per K/V (index tensors for the batch in one host->device copy), waits for that
    gather only (after it vLLM may reuse the blocks), and hands the batch to a background
    thread that copies it to the server's shared memory on a side stream and commits: the
    next step's forward runs meanwhile. `flush()` waits for that thread. The ring bounds the
    device memory held (staging_bytes); a full ring makes the next store wait. A load copies
    pieces of the run host->device on a side stream into two alternating staging halves and
    scatters each on the current stream once it landed, so copy and scatter overlap.
    On the CPU a store gathers straight into the server's shared memory (no staging), and a
    load scatters straight from it, synchronously (async_store=True forces the staged,
    background path there too: the tests run it on any machine)."""

    STAGING_TIMEOUT = 30.0  # s a store waits for staging slots before it is dropped
    PIPELINE_PIECE = 4  # chunks per gather in a pipelined store (its copies hide the next)
    MAX_RING_SLOTS, MAX_LOAD_PIECE = 128, 16  # chunks; beyond this more staging buys nothing

    def __init__(self, paged: PagedKV, layout: ModelLayout, model: str, tp_rank: int = 0,
                 pin_shm: bool = True, *, async_store: bool = False,
                 staging_bytes: int | None = None, staged: bool | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 stats_every: float = 30.0, device_wait: bool = False):
        """`on_error`: called (from the background thread) with the error of a failed
        background store, at once, so an outage is noticed without waiting for the next
        store; None keeps the error for the next store_chunks / flush to raise.
        `device_wait` (GPU): True waits for the whole device before a store's gather and
        after a load; False (default) orders the copies by the forward's stream and events
        (the connector setting of the same name)."""
        self.paged, self.layout, self.model, self.tp_rank = paged, layout, model, tp_rank
        self.on_error = on_error
        self.pin_shm = pin_shm
        self.pinned: set[int] = set()  # host allocations already page-locked for the GPU
        self._map: HostMapping | None = None  # our page-locked mapping of the segment
        self._pin_lock = threading.Lock()
        on_gpu = paged.device.type == "cuda"
        self.async_store = bool(async_store)
        # staged: through device staging (the GPU path); staged=True on the CPU runs that
        # same path there (tests)
        self.staged = (on_gpu or self.async_store) if staged is None else staged
        self.staging_bytes = staging_bytes or default_staging_bytes(paged.device)
        self._ring: StagingRing | None = None  # allocated on the first staged store
        self._load_buf: torch.Tensor | None = None
        self._streams = DeviceStreams(paged.device, device_wait)
        self._jobs: queue.Queue[_StoreJob | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None  # from the background thread, raised once
        self.stats = StoreStats(every=stats_every)
        self.load_stats = LoadStats(every=stats_every)

    # ---- loads ------------------------------------------------------------------------
    def load_run(self, client, run: ChunkRun) -> int:
        """Copy the run's chunks into the paged blocks; return the first token not loaded."""
        c = self.layout.chunk_size
        keys = run.keys[self.tp_rank]
        t = LoadTiming(len(keys), len(keys) * self.layout.chunk_bytes)
        t0 = time.perf_counter()
        self._host(client)  # before the lease: pinning a large segment takes seconds
        t1 = time.perf_counter()
        with client.retrieve(self.model, keys, tp_rank=self.tp_rank) as got:
            t2 = time.perf_counter()
            loaded = run.start
            try:
                if self.staged:
                    loaded = self._load_staged(run, self._on_host(client, got.tensors))
                else:
                    for i, chunk in enumerate(got.tensors):
                        lo = max(run.start, (run.first + i) * c)
                        hi = min(run.end, (run.first + i + 1) * c)
                        src = chunk[:, :, lo - (run.first + i) * c: hi - (run.first + i) * c]
                        self.paged.scatter(self.paged.slots(run.block_ids, lo, hi), src)
                        loaded = hi
            finally:  # the host->device copies landed before the lease is released (the
                t3 = time.perf_counter()  # scatters wait for them on the forward's stream)
                self._streams.load_done()
            t4 = time.perf_counter()
        t5 = time.perf_counter()
        t.map_ms, t.retrieve_ms, t.issue_ms = 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)
        t.device_wait_ms, t.release_ms, t.total_ms = 1e3 * (t4 - t3), 1e3 * (t5 - t4), \
            1e3 * (t5 - t0)
        self.load_stats.add(t)
        return loaded

    def _load_staged(self, run: ChunkRun, tensors: list[torch.Tensor]) -> int:
        """Pieces of whole chunks (and the partial first/last chunk alone): host->device on
        the load stream into one staging half while the other half is scattered."""
        c, first = self.layout.chunk_size, run.first
        pieces: list[tuple[int, int]] = []  # chunk index ranges [a, b) into tensors
        whole = [i for i in range(len(tensors))
                 if run.start <= (first + i) * c and (first + i + 1) * c <= run.end]
        is_whole = set(whole)
        buf = self._load_staging()
        half = buf.shape[0] // 2
        i = 0
        while i < len(tensors):
            if i in is_whole:
                j = i
                while j < len(tensors) and j in is_whole and j - i < half:
                    j += 1
            else:
                j = i + 1
            pieces.append((i, j))
            i = j
        rows = self.paged.chunk_slots([(run.block_ids, first + i) for i in whole], c) \
            if whole else None
        loaded, k = run.start, 0
        for n, (a, b) in enumerate(pieces):
            dst = buf[(n % 2) * half:(n % 2) * half + (b - a)]
            self._streams.load_copy(dst, tensors[a:b], n % 2)
            if a in is_whole:  # b - a whole chunks: one scatter
                part = tuple([t[k:k + b - a] for t in side] for side in rows)
                k += b - a
                self.paged.scatter_chunks(part, dst)
                loaded = (first + b) * c
            else:
                lo, hi = max(run.start, (first + a) * c), min(run.end, (first + a + 1) * c)
                self.paged.scatter(self.paged.slots(run.block_ids, lo, hi),
                                   dst[0, :, :, lo - (first + a) * c: hi - (first + a) * c])
                loaded = hi
            self._streams.scattered(n % 2)
        return loaded

    def _load_staging(self) -> torch.Tensor:
        if self._load_buf is None:
            per = self.layout.chunk_bytes
            piece = max(1, min(self.MAX_LOAD_PIECE, self.staging_bytes // 4 // (2 * per)))
            self._load_buf = torch.empty((2 * piece, *self.layout.chunk_shape),
                                         dtype=self.paged.dtype, device=self.paged.device)
        return self._load_buf

    # ---- stores -----------------------------------------------------------------------
    def store_chunks(self, client, todo: dict[bytes, tuple[list[int], int]]) -> None:
        """Store the chunks of `todo`, in requests of at most the server's keys per request
        (staged: also at most half the ring, so two batches can be in flight). Raises the
        error of an earlier background store first, if there was one."""
        self._raise_background_error()
        t0 = time.perf_counter()
        keys = list(todo)
        self._streams.wait_device()  # device_wait: the forward's KV writes, whatever stream
        self.stats.device_wait_s += time.perf_counter() - t0
        step = client.max_keys or len(keys)
        if self.staged:
            step = min(step, max(1, self._store_ring().capacity // 2))
        for i in range(0, len(keys), step):
            batch = keys[i:i + step]
            if not self.staged:
                self._store_direct(client, batch, todo)
            elif self.async_store:
                self._submit(self._gather(client, batch, todo))
            else:
                self._store_pipelined(client, batch, todo)
        self.stats.stores += 1
        self.stats.chunks += len(keys)
        self.stats.main_s += time.perf_counter() - t0
        self.stats.maybe_log()

    def log_stats(self) -> None:
        """The store and load stats lines, where due (every step: see StoreStats.maybe_log)."""
        self.stats.maybe_log()
        self.load_stats.maybe_log()

    def flush(self) -> None:
        """Wait until every background store is committed (or failed); raise its error."""
        self._jobs.join()
        self._raise_background_error()

    def _store_direct(self, client, keys: list[bytes],
                      todo: dict[bytes, tuple[list[int], int]]) -> None:
        """CPU: gather each chunk straight into the server's shared memory slot."""
        c = self.layout.chunk_size
        with client.prepare_store(self.model, keys, tp_rank=self.tp_rank) as handle:
            for j, buf in handle.writable():  # refused past the server's write TTL
                block_ids, chunk = todo[keys[j]]
                self.paged.gather(self.paged.slots(block_ids, chunk * c, (chunk + 1) * c), buf)

    def _store_pipelined(self, client, keys: list[bytes],
                         todo: dict[bytes, tuple[list[int], int]]) -> None:
        """GPU, commit in this thread: ask the server which chunks it lacks, then gather
        those in pieces of PIPELINE_PIECE chunks into staging and copy each piece to its
        shared-memory slots on the store stream as soon as its gather is done, so the
        gathers (and their launches) overlap the device->host copies; commit once every copy
        landed (which also means every gather is done: vLLM may reuse the blocks)."""
        ring = self._store_ring()
        start = ring.take(len(keys), self.STAGING_TIMEOUT)
        try:
            self._host(client)  # before the write TTL starts: it can take seconds
            with client.prepare_store(self.model, keys, tp_rank=self.tp_rank) as handle:
                missing = list(handle.missing)
                if not missing:
                    return
                host = self._on_host(client, handle.buffers)
                slots = self.paged.chunk_slots([todo[keys[i]] for i in missing],
                                               self.layout.chunk_size)
                targets = handle.writable()  # checks the write TTL before each chunk
                try:
                    for a in range(0, len(missing), self.PIPELINE_PIECE):
                        b = min(len(missing), a + self.PIPELINE_PIECE)
                        rows = tuple([t[a:b] for t in side] for side in slots)
                        self.paged.gather_chunks(rows, ring.buf[start + a:start + b])
                        self._streams.store_after_current()
                        for j in range(a, b):
                            next(targets)  # the write TTL check
                            self._streams.store_copy(host[j], ring.buf[start + j])
                finally:  # every copy landed before the commit (or the abort frees the slots)
                    self._streams.store_done()
        finally:
            ring.give(start, len(keys))

    def _store_ring(self) -> StagingRing:
        if self._ring is None:
            slots = max(2, min(self.MAX_RING_SLOTS,
                               self.staging_bytes * 3 // 4 // self.layout.chunk_bytes))
            self._ring = StagingRing(slots, self.layout.chunk_shape, self.paged.dtype,
                                     self.paged.device)
        return self._ring

    def _gather(self, client, keys: list[bytes],
                todo: dict[bytes, tuple[list[int], int]]) -> _StoreJob:
        """Queue the gather of `keys`' chunks into staging on the forward's stream. Without
        device_wait the host does not wait: stream order is what makes it safe (the gather
        runs after the forward that wrote the blocks, and whatever writes them next, the next
        forward or a load's scatter, is queued after it on the same stream); with it the host
        waits for the gather, after which vLLM may hand the blocks to anyone."""
        ring = self._store_ring()
        t0 = time.perf_counter()
        start = ring.take(len(keys), self.STAGING_TIMEOUT)
        self.stats.ring_wait_s += time.perf_counter() - t0
        try:
            slots = self.paged.chunk_slots([todo[k] for k in keys], self.layout.chunk_size)
            self.paged.gather_chunks(slots, ring.buf[start:start + len(keys)])
            gathered = self._streams.mark_current()
            self._streams.wait_event(gathered)  # device_wait: the blocks are free after it
        except BaseException:
            ring.give(start, len(keys))
            raise
        return _StoreJob(client, keys, start, gathered)

    def _finish(self, job: _StoreJob) -> None:
        """Copy a gathered batch to the server's slots and commit it (the background thread
        does this when async_store); its staging slots are free again afterwards."""
        ring, t0 = self._store_ring(), time.perf_counter()
        try:
            self._host(job.client)  # before the write TTL starts: it can take seconds
            with job.client.prepare_store(self.model, job.keys, tp_rank=self.tp_rank) as handle:
                host = self._on_host(job.client, handle.buffers)
                self._streams.store_after(job.gathered)
                try:
                    for (j, _), buf in zip(handle.writable(), host):  # refused past the TTL
                        self._streams.store_copy(buf, ring.buf[job.start + j])
                finally:  # every copy landed before the commit (or the abort frees the slots)
                    self._streams.store_done()
        finally:
            ring.give(job.start, len(job.keys))
            self.stats.background_s += time.perf_counter() - t0

    def _submit(self, job: _StoreJob) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._drain, daemon=True,
                                            name=f"kvedit-store-{self.tp_rank}")
            self._worker.start()
        self._jobs.put(job)

    def _drain(self) -> None:
        self._streams.bind_thread()
        while (job := self._jobs.get()) is not None:
            try:
                self._finish(job)
            except BaseException as e:  # reported now, or by the next store_chunks / flush
                if self.on_error is not None:
                    self._report(e)
                elif self._error is None:
                    self._error = e
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _report(self, err: BaseException) -> None:
        try:
            self.on_error(err)
        except Exception:  # the handler must not kill the store thread
            logger.exception("kvedit: reporting a failed background store failed")

    def _raise_background_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Let the background thread finish what it holds, then stop it; unmap our segment
        mapping."""
        if self._worker is not None and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=self.STAGING_TIMEOUT)
        with self._pin_lock:
            if self._map is not None:
                self._map.close()
                self._map = None

    def prepare(self, client) -> None:
        """Map (and on a GPU page-lock) the server's segment now rather than in the first
        store or load. Page-locking takes ~0.6 s a GiB on the H200 host and holds up every
        CUDA call of the process meanwhile: at the first store that paused a serving
        engine's forward for 3-5 s (a 7 GiB segment); at vLLM's start-up it delays only
        the start."""
        self._host(client)

    def _host(self, client) -> HostMapping | None:
        """Our own mapping of the client's current segment (None over the socket, or on the
        CPU's direct path), made and page-locked on first use and again after a server
        restart (HostMapping says why not the client's mapping). Page-locking populates the
        whole segment: one pause proportional to its size (docs/gpu.md, session 3,
        "Page-locking")."""
        seg = client.segment() if self.staged else None
        if seg is None:
            return None
        path = seg[0]
        with self._pin_lock:  # loads (vLLM's thread) and stores (background) both map
            if self._map is not None and self._map.current(path):
                return self._map
            old, self._map = self._map, None
            if old is not None:
                old.close()
            t0 = time.perf_counter()
            pin = self.paged.device.type == "cuda" and self.pin_shm
            self._map = HostMapping(path, pin)
            if pin:
                self.pinned.add(self._map.bytes.untyped_storage().data_ptr())
                logger.info("kvedit: page-locking the server segment (%.1f GiB) %s in %.1f s",
                            self._map.bytes.numel() / 2**30,
                            "done" if self._map.pinned else "FAILED", time.perf_counter() - t0)
            return self._map

    def _on_host(self, client, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` (views into the client's segment) as views of our own mapping."""
        m, seg = self._host(client), client.segment()
        if m is None or seg is None:
            return tensors
        if not m.current(seg[0]):  # the client re-attached since: follow it
            m = self._host(client)
        return [m.view_of(t, seg[1]) for t in tensors]
