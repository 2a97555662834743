"""Copies between vLLM's paged KV caches and kvedit chunk tensors [2, L, C, D].

Pure torch (no vllm/msgspec import), so the layouts can be tested on any machine.

Each layout says where K (and V) of one head of one token sits inside vLLM's per-layer
tensor [blocks, H, N, 2*hd], as strides: the in-block position n and the head dim d may be
split into factors (CPU AMX tiles interleave them). From those strides we build one strided
view per K/V covering every layer — [L, blocks, *n_factors, H, *d_factors] — and a whole
chunk moves in ONE advanced-indexing op per K/V: a gather (`aten.index` written straight
into the destination, e.g. the server's shared memory) or a scatter (`index_put_`), with
index tensors of length T. No Python loop over tokens, blocks or layers.

On the CUDA layout the views reinterpret the cache as 16-byte elements (complex128 as a
carrier: 8 bf16 or 4 float32 values of one head's K or V, never arithmetic), so the index
kernels move 16 bytes per element instead of 2 (the element count, not the bytes, bounds
those kernels: 305 GB/s with bf16 elements on an H200 in session 2).
`chunk_slots` + `gather_chunks` / `scatter_chunks` move many whole chunks in one op per
K/V, chunk-major ([n, 2, L, C, D], the server's slot order), with one host-to-device copy
of all their index tensors. `StagingRing` is the device-side staging the connector's
pipelined copies use (kvedit.vllm.worker_side.PagedCopier).

Layouts (from vLLM 0.32's attention backends; tests check them against vLLM's own ops):
- "cuda"    FlashAttention / FlashInfer: logical [B, H, N, 2hd], K = [..., :hd],
            V = [..., hd:]; any physical stride order (NHD or HND) works via the strides.
- "cpu"     CPU backend, ISA vec/vec16: each [block, head] tile is K as [hd, N] (transposed)
            followed by V as [N, hd].
- "cpu_amx" CPU backend, ISA amx (bf16): K in 16-token groups of dim pairs
            [N/16, hd/2, 16, 2], then V in 16-dim groups of token pairs [hd/16, N/2, 16, 2].
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

LAYOUTS = ("cuda", "cpu", "cpu_amx")
WIDE = torch.complex128  # the 16-byte carrier element of the wide views (see above)

Factors = tuple[tuple[int, int], ...]  # (size, stride) pairs, major first


@dataclass(frozen=True)
class _Side:
    """Where K or V of one head of one token lives, relative to the layer's block 0, head 0."""
    offset: int
    pos: Factors  # the in-block position n, split into factors
    dim: Factors  # the head dim d, split into factors


def _sides(t: torch.Tensor, kind: str, hd: int) -> tuple[_Side, _Side]:
    if t.dim() != 4 or t.shape[3] != 2 * hd:
        raise ValueError(f"paged KV layer of shape {tuple(t.shape)}: expected "
                         f"[blocks, kv_heads, block_size, 2*head_dim={2 * hd}]")
    n, (_, s1, s2, s3) = t.shape[2], t.stride()
    if s3 != 1:
        raise ValueError(f"paged KV layer strides {t.stride()}: last dim must be contiguous")
    if kind == "cuda":
        return _Side(0, ((n, s2),), ((hd, 1),)), _Side(hd, ((n, s2),), ((hd, 1),))
    if kind not in LAYOUTS:
        raise ValueError(f"unknown paged layout {kind!r}; expected one of {LAYOUTS}")
    if s2 != 2 * hd or s1 != n * 2 * hd:
        raise ValueError(f"CPU paged KV layer strides {t.stride()}: expected contiguous "
                         "[block, head] tiles")
    if kind == "cpu":
        return _Side(0, ((n, 1),), ((hd, n),)), _Side(n * hd, ((n, hd),), ((hd, 1),))
    if n % 16 or hd % 16:
        raise ValueError(f"AMX tiles need block size and head_dim multiples of 16, got {n}, {hd}")
    return (_Side(0, ((n // 16, 16 * hd), (16, 2)), ((hd // 2, 32), (2, 1))),
            _Side(n * hd, ((n // 2, 32), (2, 1)), ((hd // 16, 16 * n), (16, 2))))


class PagedKV:
    """All layers of one vLLM worker's paged KV cache, addressed by token slot."""

    def __init__(self, layers: list[torch.Tensor], kind: str, head_dim: int,
                 block_size: int | None = None, wide: bool = True):
        if not layers:
            raise ValueError("no KV cache layers")
        first = layers[0]
        if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
               for t in layers):
            raise ValueError("KV cache layers differ in shape, strides or dtype")
        self.kind, self.head_dim, self.num_layers = kind, head_dim, len(layers)
        self.num_heads, self.kernel_block = first.shape[1], first.shape[2]
        self.device, self.dtype = first.device, first.dtype
        # vLLM's block ids count scheduler blocks; a backend may split each into several
        # kernel blocks ("virtual block splitting"), so keep the ratio.
        self.block_size = block_size or self.kernel_block
        if self.block_size % self.kernel_block:
            raise ValueError(f"block size {self.block_size} is not a multiple of the kernel "
                             f"block size {self.kernel_block}")
        self.sides = _sides(first, kind, head_dim)
        # Layers sharing a storage at a uniform stride become one view (one op per K/V).
        self.groups: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]] = []
        runs, start = [], 0
        while start < len(layers):
            end = start + 1
            while end < len(layers) and _same_run(layers, start, end):
                end += 1
            runs.append(layers[start:end])
            self.groups.append((start, end, self._views(layers[start:end], 1)))
            start = end
        # The same views in 16-byte elements where every stride and offset allows it.
        self.ratio = WIDE.itemsize // self.dtype.itemsize if wide and kind == "cuda" else 1
        if self.ratio > 1 and not all(_widens(run, self.sides, self.ratio) for run in runs):
            self.ratio = 1
        self.wide_groups = [(lo, hi, self._views(run, self.ratio)) for (lo, hi, _), run
                            in zip(self.groups, runs)] if self.ratio > 1 else None

    def _views(self, run: list[torch.Tensor], r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views [L', blocks, *pos factors, H, *dim factors] of K and of V, in
        elements of `r` values (r > 1: WIDE; the contiguous dim factor shrinks by r)."""
        t = run[0]
        dtype = WIDE if r > 1 else t.dtype
        flat = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage())
        s_layer = run[1].storage_offset() - t.storage_offset() if len(run) > 1 else 0
        views = []
        for side in self.sides:
            dim = [(n // r, 1) if s == 1 else (n, s // r) for n, s in side.dim]
            sizes = [len(run), t.shape[0], *(f[0] for f in side.pos), t.shape[1],
                     *(f[0] for f in dim)]
            strides = [s_layer // r, t.stride(0) // r, *(f[1] // r for f in side.pos),
                       t.stride(1) // r, *(f[1] for f in dim)]
            views.append(flat.as_strided(sizes, strides,
                                         (t.storage_offset() + side.offset) // r))
        return views[0], views[1]

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    def slots(self, block_ids, start: int, end: int) -> tuple[list[torch.Tensor], ...]:
        """Index tensors of the tokens in [start, end) for K and for V: (kernel block,
        *position factors), given the request's scheduler block ids."""
        pos = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // self.block_size]
        return self._to_device(self._host_slots(blocks, pos % self.block_size))

    def chunk_slots(self, chunks: list[tuple[list[int], int]],
                    chunk_size: int) -> tuple[list[torch.Tensor], ...]:
        """Index tensors [n, chunk_size] of whole chunks, one row per (scheduler block ids of
        its request, chunk index), for gather_chunks / scatter_chunks: built on the host in
        one pass and moved to the device in ONE copy (a copy per chunk would also wait for
        the device)."""
        bs = self.block_size
        pos = torch.arange(chunk_size, dtype=torch.int64)
        if chunk_size % bs == 0:  # each chunk is whole scheduler blocks: one block table
            per = chunk_size // bs
            table = torch.tensor([ids[i * per:(i + 1) * per] for ids, i in chunks],
                                 dtype=torch.int64)
            blocks = table[:, pos // bs]
        else:
            blocks = torch.stack([torch.as_tensor(ids, dtype=torch.int64)[
                (pos + i * chunk_size) // bs] for ids, i in chunks])
            pos = torch.stack([pos + i * chunk_size for _, i in chunks])
        return self._to_device(self._host_slots(blocks, (pos % bs).expand(blocks.shape)))

    def _host_slots(self, blocks: torch.Tensor, within: torch.Tensor) -> tuple[list, list]:
        """(kernel block, *position factors) for K and V of tokens at scheduler block
        `blocks`, position `within` it (tensors of one shape)."""
        kblock = blocks * (self.block_size // self.kernel_block) + within // self.kernel_block
        n = within % self.kernel_block
        out, seen = [], {}
        for side in self.sides:
            if side.pos not in seen:  # K and V split positions alike on CUDA: share them
                factors, rest = [], n
                for size, _ in reversed(side.pos):  # mixed radix, minor factor first
                    factors.append(rest % size)
                    rest = rest // size
                seen[side.pos] = [kblock, *reversed(factors)]
            out.append(seen[side.pos])
        return out[0], out[1]

    def _to_device(self, host: tuple[list[torch.Tensor], ...]) -> tuple[list[torch.Tensor], ...]:
        """One copy for all index tensors (K's and V's are often the same tensors)."""
        if self.device.type == "cpu":
            return host
        flat = [t for side in host for t in side]
        ids = _identity(flat)
        uniq = [flat[ids.index(i)] for i in range(max(ids) + 1)]
        # non_blocking from pageable memory: CUDA stages the bytes before returning, and
        # unlike a blocking copy this does not wait for the work queued on the stream.
        moved = torch.stack(uniq).to(self.device, non_blocking=True).unbind(0)
        n_k = len(host[0])
        return [moved[i] for i in ids[:n_k]], [moved[i] for i in ids[n_k:]]

    def _split(self, t: torch.Tensor, kv: int, r: int = 1) -> torch.Tensor:
        """[L', *S, D] -> [L', *S, H, *dim factors] (a view), in elements of r values."""
        dims = [n // r if s == 1 else n for n, s in self.sides[kv].dim]
        return t.unflatten(-1, (self.num_heads, *dims))

    def _plan(self, t: torch.Tensor):
        """(groups, r, t as seen by their views): the wide views when `t` can be
        reinterpreted in 16-byte elements (contiguous rows at 16-byte addresses)."""
        if self.wide_groups is not None and t.stride(-1) == 1 and t.dtype == self.dtype \
                and t.data_ptr() % WIDE.itemsize == 0:
            try:
                return self.wide_groups, self.ratio, t.view(WIDE)
            except RuntimeError:  # an odd offset or stride: the element views
                pass
        return self.groups, 1, t

    def gather(self, slots: tuple[list[torch.Tensor], ...], out: torch.Tensor) -> None:
        """Copy the tokens at `slots` into `out` [2, L, T, D] (on self.device)."""
        groups, r, out = self._plan(out)
        for lo, hi, views in groups:
            for kv in (0, 1):
                torch.ops.aten.index.Tensor_out(views[kv], [None, *slots[kv]],
                                                out=self._split(out[kv, lo:hi], kv, r))

    def scatter(self, slots: tuple[list[torch.Tensor], ...], src: torch.Tensor) -> None:
        """Copy `src` [2, L, T, D] (on self.device) into the tokens at `slots`."""
        groups, r, src = self._plan(src)
        for lo, hi, views in groups:
            for kv in (0, 1):
                torch.ops.aten.index_put_(views[kv], [None, *slots[kv]],
                                          self._split(src[kv, lo:hi], kv, r))

    def gather_chunks(self, slots: tuple[list[torch.Tensor], ...], out: torch.Tensor) -> None:
        """Copy whole chunks (`chunk_slots`) into `out` [n, 2, L, C, D]: one op per K/V and
        layer group for all n chunks."""
        groups, r, out = self._plan(out)
        for lo, hi, views in groups:
            for kv in (0, 1):
                dst = self._split(out[:, kv, lo:hi].transpose(0, 1), kv, r)  # [L', n, C, ..]
                torch.ops.aten.index.Tensor_out(views[kv], [None, *slots[kv]], out=dst)

    def scatter_chunks(self, slots: tuple[list[torch.Tensor], ...], src: torch.Tensor) -> None:
        """Copy whole chunks `src` [n, 2, L, C, D] into the tokens at `slots` (chunk_slots)."""
        groups, r, src = self._plan(src)
        for lo, hi, views in groups:
            for kv in (0, 1):
                torch.ops.aten.index_put_(views[kv], [None, *slots[kv]],
                                          self._split(src[:, kv, lo:hi].transpose(0, 1), kv, r))


def wait_for_device(device: torch.device) -> None:
    """Wait for every stream on `device` (nothing on the CPU).

    vLLM runs its forward on a stream of its own (vllm.utils.torch_utils.current_stream, a
    non-blocking stream that does not order against the legacy default stream), and which
    stream is current for the connector's code is vLLM's business. So the connector orders
    its copies against the forward by waiting for the whole device: before gathering a step's
    freshly written KV, and after scattering loaded KV (before the forward reads it and
    before the server's lease on the source is released). On the first H200 run of the GPU
    suite, without this, 5 of 40 tests saw all-zero stored chunks or wrong loaded KV; a
    second run on the same machine passed all 40 (a race)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _identity(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the number of the first tensor that is the same object."""
    first: dict[int, int] = {}
    return [first.setdefault(id(t), len(first)) for t in tensors]


def _widens(run: list[torch.Tensor], sides: tuple[_Side, _Side], r: int) -> bool:
    """Can this run of layers be viewed in elements of r values: every offset and stride a
    multiple of r, and r dividing the contiguous head-dim factor of K and V?"""
    t = run[0]
    offsets = [t.storage_offset(), *(x.storage_offset() for x in run[1:2])]
    strides = [*t.stride()[:3]] + [f[1] for side in sides for f in side.pos]
    ok = all(v % r == 0 for v in offsets + strides + [side.offset for side in sides])
    for side in sides:
        ok = ok and all(n % r == 0 for n, s in side.dim if s == 1) and \
            all(s % r == 0 for _, s in side.dim if s != 1)
    elem = t.element_size()
    return ok and t.untyped_storage().data_ptr() % (r * elem) == 0


def _same_run(layers: list[torch.Tensor], start: int, end: int) -> bool:
    """Does layer `end` continue the uniform-stride run of layers[start:end] in one storage?"""
    a, b = layers[start], layers[end]
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    step = layers[start + 1].storage_offset() - a.storage_offset() if end > start + 1 else None
    gap = b.storage_offset() - layers[end - 1].storage_offset()
    return gap > 0 and (step is None or gap == step)


# Host allocation address -> (the tensor over it, registered?). Holding the tensor keeps the
# mapping alive while CUDA has it registered: a server restart makes the client map a new
# segment, and if the old one were unmapped first, the new mapping could land at the same
# address, look registered, and DMA would go to the old segment's pages (stored chunks read
# back as zeros after the GPU suite's server-restart test, on the H200).
_PINNED: dict[int, tuple[torch.Tensor, bool]] = {}
_PIN_LOCK = threading.Lock()


def _cudart_call(fn) -> int:
    """Run one CUDA runtime call in a thread of its own and return its code: a failed call
    leaves a "last error" in its thread, and torch reports that at the thread's next kernel
    launch (seen on the H200: "part or all of the requested memory range is already
    mapped" raised by a gather after a repeated registration)."""
    device = torch.cuda.current_device()
    rc: list[int] = []

    def call():
        torch.cuda.set_device(device)  # the calling thread's device (TP ranks differ)
        rc.append(int(fn(torch.cuda.cudart())))
    t = threading.Thread(target=call, name="kvedit-pin")
    t.start()
    t.join()
    return rc[0] if rc else -1


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock the whole host allocation behind `t` (e.g. the server's shared-memory
    segment) so copies between it and the GPU run as DMA, not through a bounce buffer.
    Returns False if CUDA refuses (the copies still work, just slower). Once per allocation
    per process; it stays mapped and registered until unpin_host."""
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    with _PIN_LOCK:
        if ptr not in _PINNED:
            rc = _cudart_call(lambda rt: rt.cudaHostRegister(ptr, nbytes, 0))
            _PINNED[ptr] = (t, rc == 0)
        return _PINNED[ptr][1]


def unpin_host(t: torch.Tensor) -> None:
    """Undo pin_host (e.g. the server restarted and the client mapped a new segment); the
    old mapping can go once nothing else holds it."""
    ptr = t.untyped_storage().data_ptr()
    with _PIN_LOCK:
        entry = _PINNED.pop(ptr, None)
        if entry is not None and entry[1]:
            _cudart_call(lambda rt: rt.cudaHostUnregister(ptr))


class HostMapping:
    """This process's own mapping of the server's shared-memory file, page-locked once for
    the GPU (pin=True). The connector's DMA copies go through it rather than through the
    client's mapping: the client unmaps its segment when the server restarts, and a
    registered range that gets unmapped and mapped again at the same address still looks
    page-locked to CUDA, whose copies then go to the old segment's pages (on the H200 the
    GPU suite's stores after test_server_outage read back as zeros). This mapping lives
    until close(), which unregisters it first; `current` says whether it still maps the
    file now at its path (a restarted server makes a new file)."""

    def __init__(self, path: str, pin: bool):
        st = os.stat(path)
        self.path, self.ident = path, (st.st_dev, st.st_ino)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        self.bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = pin_host(self.bytes) if pin else False

    def current(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return path == self.path and (st.st_dev, st.st_ino) == self.ident

    def view_of(self, t: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """The bytes of `t` (a contiguous view into the client's mapping `seg` of the same
        file) as a tensor of this mapping."""
        off, nbytes = t.data_ptr() - seg.data_ptr(), t.numel() * t.element_size()
        if not t.is_contiguous() or off < 0 or off + nbytes > self.bytes.numel():
            raise ValueError(f"kvedit: a host tensor of {nbytes} bytes at offset {off} is not "
                             f"a contiguous part of the {self.bytes.numel()}-byte segment")
        return self.bytes[off:off + nbytes].view(t.dtype).view(t.shape)

    def close(self) -> None:
        if self.bytes is None:
            return
        if self.pinned:
            unpin_host(self.bytes)
        self.bytes = None
        try:
            self._mm.close()
        except BufferError:  # views still alive elsewhere: the mapping goes with them
            pass


class StagingRing:
    """A fixed pool of chunk slots [slots, *chunk_shape] on the device, handed out as
    contiguous ranges (so a batch of chunks is one gather target) and given back oldest first
    (the connector drains its store jobs in order). `take` blocks while the pool is full, at
    most `timeout` seconds: the pool bounds the device memory that stores in flight hold."""

    def __init__(self, slots: int, chunk_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        if slots < 1:
            raise ValueError(f"staging ring of {slots} slots; expected at least 1")
        self.capacity = slots
        self.buf = torch.empty((slots, *chunk_shape), dtype=dtype, device=device)
        self._cv = threading.Condition()
        self._live: deque[tuple[int, int]] = deque()  # (start, n) handed out, oldest first
        self._head = 0  # where the next range starts if it fits before the end

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # used: [tail, head); free: [head, cap) and [0, tail)
            if self.capacity - self._head >= n:
                return self._head
            return 0 if tail >= n else None
        return self._head if tail - self._head >= n else None  # wrapped: free [head, tail)

    def take(self, n: int, timeout: float) -> int:
        """Start of a free range of n slots (n <= capacity)."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"{n} chunks for a staging ring of {self.capacity} slots")
        deadline = time.monotonic() + timeout
        with self._cv:
            while (start := self._fit(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kvedit: GPU staging full ({self.capacity} chunks in "
                                       f"flight to the server for {timeout:.0f} s)")
                self._cv.wait(left)
            self._live.append((start, n))
            self._head = start + n
            return start

    def give(self, start: int, n: int) -> None:
        """Hand back the oldest range (it must be the one at `start`)."""
        with self._cv:
            if not self._live or self._live[0] != (start, n):
                raise RuntimeError(f"staging range ({start}, {n}) given back out of order; "
                                   f"oldest is {self._live[0] if self._live else None}")
            self._live.popleft()
            if not self._live:
                self._head = 0
            self._cv.notify_all()

    @property
    def in_use(self) -> int:
        with self._cv:
            return sum(n for _, n in self._live)


def default_staging_bytes(device: torch.device) -> int:
    """Device memory for the connector's staging (3/4 store ring, 1/4 load halves): 2 GiB,
    or 1/32 of a smaller GPU's memory. vLLM does not count it in its own budget, so it
    stays well inside what --gpu-memory-utilization leaves free (0.1 of the GPU by
    default)."""
    if device.type != "cuda":
        return 256 << 20
    total = torch.cuda.get_device_properties(device).total_memory
    return min(2 << 30, total // 32)


class DeviceStreams:
    """Side streams and events for the connector's pipelined copies on CUDA: device->host
    copies of stores on one stream, host->device copies of loads on another, ordered against
    the gathers / scatters on the current stream by events. On the CPU every copy runs
    inline and there is nothing to order."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            self.load_stream = torch.cuda.Stream(device)
            self.store_stream = torch.cuda.Stream(device)
        self._free: list = [None, None]  # per load staging half: after its last scatter

    def bind_thread(self) -> None:
        """A thread that queues copies on this device (the background store thread)."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def wait_current(self) -> None:
        """Block until the work queued so far on the current stream (a gather) is done."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()

    def load_copy(self, dst: torch.Tensor, srcs: list[torch.Tensor], half: int) -> None:
        """Host chunks -> dst (staging half `half`), after that half's previous scatter; the
        current stream waits for the copies before anything queued after this call."""
        if not self.cuda:
            for d, s in zip(dst, srcs):
                d.copy_(s)
            return
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.load_stream):
            if self._free[half] is not None:
                self.load_stream.wait_event(self._free[half])
            for d, s in zip(dst, srcs):
                d.copy_(s, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.load_stream)
        current.wait_event(ready)

    def scattered(self, half: int) -> None:
        """The scatter from staging half `half` is queued: its next copy waits for it."""
        if self.cuda:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
            self._free[half] = free

    def store_after_current(self) -> None:
        """Store copies queued from now on wait for the work queued so far on the current
        stream (a gather into staging); the host does not wait."""
        if self.cuda:
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(self.device))
            self.store_stream.wait_event(gathered)

    def store_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device staging -> host slot, queued on the store stream (or inline on the CPU)."""
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.store_stream):
            dst.copy_(src, non_blocking=True)

    def store_done(self) -> None:
        """Block until every queued store copy landed."""
        if self.cuda:
            self.store_stream.synchronize()
