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
those kernels; docs/gpu.md has the measured rates).
`chunk_slots` + `gather_chunks` / `scatter_chunks` move many whole chunks in one op per
K/V, chunk-major ([n, 2, L, C, D], the server's slot order), with one host-to-device copy
of all their index tensors. `StagingRing` is the device-side staging the connector's
pipelined copies use (kvedit.vllm.transfer.copier.PagedCopier); it and the page-locked
mappings live in kvedit.vllm.transfer.gpu_memory.

Layouts (from vLLM 0.32's attention backends; tests check them against vLLM's own ops):
- "cuda"    FlashAttention / FlashInfer: logical [B, H, N, 2hd], K = [..., :hd],
            V = [..., hd:]; any physical stride order (NHD or HND) works via the strides.
- "cpu"     CPU backend, ISA vec/vec16: each [block, head] tile is K as [hd, N] (transposed)
            followed by V as [N, hd].
- "cpu_amx" CPU backend, ISA amx (bf16): K in 16-token groups of dim pairs
            [N/16, hd/2, 16, 2], then V in 16-dim groups of token pairs [hd/16, N/2, 16, 2].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvedit.vllm import paged_kernels

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
        # CPU layouts: each layer's kernel block is one contiguous tile of every head's K and
        # V, so a copy can move whole blocks ([L', blocks, block elements] per layer group).
        # Only the AMX layout gains: the "cpu" layout's K is a transposed tile, and reordering
        # it whole costs more than its per-token ops.
        self.block_views = [self._block_view(run) for run in runs] \
            if kind == "cpu_amx" and self.device.type == "cpu" else None
        # Layers in separate allocations (vLLM 0.26 on CUDA): token gathers and scatters in
        # one Triton launch for every layer instead of one op per (K/V, layer group).
        self.table = None
        if len(self.groups) > 1 and paged_kernels.available(layers, kind):
            self.table = _checked_table(self, layers, head_dim)

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
        return self.slots_at(block_ids, torch.arange(start, end, dtype=torch.int64))

    def slots_at(self, block_ids, positions: torch.Tensor) -> tuple[list[torch.Tensor], ...]:
        """`slots` of the tokens at `positions` (a host LongTensor, any order)."""
        return self.slots_many([(block_ids, positions)])

    def slots_many(self, runs: list[tuple[list[int], torch.Tensor]]
                   ) -> tuple[list[torch.Tensor], ...]:
        """`slots_at` of several requests' tokens, one after another: `runs` holds (scheduler
        block ids, host LongTensor of positions) per request; one copy to the device."""
        blocks = torch.cat([torch.as_tensor(ids, dtype=torch.int64)[pos // self.block_size]
                            for ids, pos in runs])
        within = torch.cat([pos % self.block_size for _, pos in runs])
        return self._to_device(self._host_slots(blocks, within))

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

    def _kernel(self, slots: tuple[list[torch.Tensor], ...], t: torch.Tensor) -> bool:
        """Whether `gather`/`scatter` can use the one-launch kernels for dense `t`."""
        return self.table is not None and t.is_contiguous() and t.dtype == self.dtype \
            and t.dim() == 4 and t.shape[:2] == (2, self.num_layers) \
            and t.data_ptr() % self.table.word == 0 and len(slots[0]) == 2

    def gather(self, slots: tuple[list[torch.Tensor], ...], out: torch.Tensor) -> None:
        """Copy the tokens at `slots` into `out` [2, L, T, D] (on self.device)."""
        if self._kernel(slots, out):
            self.table.gather(*slots[0], out)
            return
        if self._blockwise_gather(slots, out):
            return
        self._gather_slots(slots, out)

    def _gather_slots(self, slots: tuple[list[torch.Tensor], ...], out: torch.Tensor) -> None:
        """`gather` by one advanced-indexing op per K/V and layer group."""
        groups, r, out = self._plan(out)
        for lo, hi, views in groups:
            for kv in (0, 1):
                torch.ops.aten.index.Tensor_out(views[kv], [None, *slots[kv]],
                                                out=self._split(out[kv, lo:hi], kv, r))

    def scatter(self, slots: tuple[list[torch.Tensor], ...], src: torch.Tensor) -> None:
        """Copy `src` [2, L, T, D] (on self.device) into the tokens at `slots`."""
        if self._kernel(slots, src):
            self.table.scatter(*slots[0], src)
            return
        rest = self._blockwise_scatter(slots, src)
        if rest is None:
            self._scatter_slots(slots, src)
        elif rest.numel():
            self._scatter_slots(tuple([t[rest] for t in side] for side in slots),
                                src.index_select(2, rest))

    def _scatter_slots(self, slots: tuple[list[torch.Tensor], ...], src: torch.Tensor) -> None:
        """`scatter` by one advanced-indexing op per K/V and layer group."""
        groups, r, src = self._plan(src)
        for lo, hi, views in groups:
            for kv in (0, 1):
                torch.ops.aten.index_put_(views[kv], [None, *slots[kv]],
                                          self._split(src[kv, lo:hi], kv, r))

    # Whole-block copies (the CPU AMX layout). A token's K or V there is spread over its block
    # in runs of two elements (interleaved tiles), so an indexing op per token moves tiny runs
    # with per-element index arithmetic. Instead: copy the whole blocks touched (contiguous
    # tiles), and reorder between the block layout and token order with plain strided copies
    # of whole blocks; tokens are then picked in token order, where each is one contiguous
    # row. Anything irregular (blocks mostly not covered, a block written twice or only in
    # part, another dtype or shape) keeps the per-token ops.

    def _block_view(self, run: list[torch.Tensor]) -> torch.Tensor:
        """[L', blocks, block elements] of a layer group (each block is contiguous)."""
        t = run[0]
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        s_layer = run[1].storage_offset() - t.storage_offset() if len(run) > 1 else 0
        return flat.as_strided((len(run), t.shape[0], t[0].numel()),
                               (s_layer, t.stride(0), 1), t.storage_offset())

    def _tiles(self, buf: torch.Tensor, kv: int) -> torch.Tensor:
        """K or V of contiguous blocks `buf` [L', nb, block elements] as
        [L', nb, *pos factors, H, *dim factors] (token order within each block)."""
        side, (lb, nb, size) = self.sides[kv], buf.shape
        head = size // self.num_heads
        sizes = [lb, nb, *(f[0] for f in side.pos), self.num_heads, *(f[0] for f in side.dim)]
        strides = [nb * size, size, *(f[1] for f in side.pos), head, *(f[1] for f in side.dim)]
        return buf.as_strided(sizes, strides, buf.storage_offset() + side.offset)

    def _tokens(self, t: torch.Tensor, kv: int) -> torch.Tensor:
        """[L', nb * N, D] -> [L', nb, *pos factors, H, *dim factors] (a view)."""
        pos = [f[0] for f in self.sides[kv].pos]
        return self._split(t.unflatten(1, (-1, *pos)), kv)

    def _positions(self, slots: tuple[list[torch.Tensor], ...]) -> tuple[torch.Tensor, ...]:
        """(kernel block, position in it) of each token, from K's index tensors."""
        kblock, *factors = slots[0]
        n = torch.zeros_like(kblock)
        for (size, _), f in zip(self.sides[0].pos, factors):
            n = n * size + f
        return kblock, n

    def _fits(self, slots, t: torch.Tensor) -> bool:
        return self.block_views is not None and t.dtype == self.dtype and t.dim() == 4 \
            and t.shape[:2] == (2, self.num_layers) and t.shape[3] == self.hidden \
            and slots[0][0].dim() == 1 and slots[0][0].numel() == t.shape[2] > 0

    def _blockwise_gather(self, slots, out: torch.Tensor) -> bool:
        """`gather` by whole blocks where the tokens fill most of the blocks they touch."""
        if not self._fits(slots, out) or not out.is_contiguous():
            return False
        kblock, n = self._positions(slots)
        blocks, inv = torch.unique(kblock, return_inverse=True)
        N, T = self.kernel_block, kblock.numel()
        if blocks.numel() * N > 2 * T:
            return False
        tokens = torch.empty((2, self.num_layers, blocks.numel() * N, self.hidden),
                             dtype=self.dtype)
        for (lo, hi, _), view in zip(self.groups, self.block_views):
            buf = view.index_select(1, blocks)
            for kv in (0, 1):
                _copy(self._tokens(tokens[kv, lo:hi], kv), self._tiles(buf, kv))
        at = inv * N + n
        cut = ((at[1:] - at[:-1]) != 1).nonzero().flatten().add_(1).tolist()
        if len(cut) < 4:  # a few runs of consecutive tokens (e.g. sinks and a recent window)
            firsts = at[[0, *cut]].tolist()
            for a, b, f in zip([0, *cut], [*cut, T], firsts):
                out[:, :, a:b].copy_(tokens[:, :, f:f + b - a])
        else:
            torch.index_select(tokens, 2, at, out=out)
        return True

    def _blockwise_scatter(self, slots, src: torch.Tensor) -> torch.Tensor | None:
        """`scatter` whole blocks where the tokens fill a kernel block in order (positions
        0..N-1, e.g. the middle of a range of slots); returns the indices of the other
        tokens, for the per-token ops (None: none written here)."""
        if not self._fits(slots, src):
            return None
        kblock, n = self._positions(slots)
        N, T = self.kernel_block, kblock.numel()
        if T < N:
            return None
        step = (kblock[1:] == kblock[:-1]) & (n[1:] == n[:-1] + 1)
        runs = torch.zeros(T, dtype=torch.int64)
        runs[1:] = step.cumsum(0)
        starts = ((n[:T - N + 1] == 0) & (runs[N - 1:] - runs[:T - N + 1] == N - 1)) \
            .nonzero().flatten()
        if not starts.numel():
            return None
        blocks = kblock[starts]
        ids = blocks.tolist()
        whole = (starts[:, None] + torch.arange(N)).flatten()
        covered = torch.zeros(T, dtype=torch.bool)
        covered[whole] = True
        rest = (~covered).nonzero().flatten()
        # A block written twice (or also partly): the per-token ops decide which bytes win.
        if len(set(ids)) < len(ids) or torch.isin(kblock[rest], blocks).any():
            return None
        nb, s0 = blocks.numel(), int(starts[0])
        if torch.equal(starts, s0 + N * torch.arange(nb)):
            part = src[:, :, s0:s0 + nb * N]
        else:
            part = src.index_select(2, whole)
        for (lo, hi, _), view in zip(self.groups, self.block_views):
            buf = torch.empty((hi - lo, nb, view.shape[2]), dtype=self.dtype)
            for kv in (0, 1):
                _copy(self._tiles(buf, kv), self._tokens(part[kv, lo:hi], kv))
            for j, b in enumerate(ids):  # plain block copies beat index_copy_ here
                view[:, b].copy_(buf[:, j])
        return rest

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


_PAIRS = {1: torch.int16, 2: torch.int32, 4: torch.int64}  # carriers of two elements


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) of equal shapes and dtypes; where both have the head dim's last factor
    as contiguous pairs (AMX K tiles), copied as one integer per pair: the same bytes, half
    the elements, and the copy loop no longer runs over a dimension of 2."""
    wide = _PAIRS.get(dst.element_size())
    if wide is not None and dst.shape[-1] == 2 and dst.stride(-1) == src.stride(-1) == 1:
        try:
            dst, src = dst.view(wide), src.view(wide)
        except RuntimeError:  # an odd stride or offset: element by element
            pass
    dst.copy_(src)


def _checked_table(paged: PagedKV, layers: list[torch.Tensor], head_dim: int):
    """The kernels' table, compiled now (about a second each, not in the first compaction)
    and checked against the per-layer ops on the first slots of block 0: read them both ways
    and write the same bytes back (the engine is not serving yet when the worker binds its
    caches). A failure or a difference keeps the per-layer ops, with a warning."""
    import logging

    try:
        table = paged_kernels.LayerTable(layers, head_dim)
        blocks = max(1, min(2, layers[0].shape[0] * paged.kernel_block // paged.block_size))
        slots = paged.slots(list(range(blocks)), 0, blocks * paged.block_size)
        shape = (2, paged.num_layers, slots[0][0].numel(), paged.hidden)
        got = torch.empty(shape, dtype=paged.dtype, device=paged.device)
        want = torch.empty_like(got)
        table.gather(*slots[0], got)
        paged.gather(slots, want)     # paged.table is still None: the per-layer ops
        if not torch.equal(got.view(table.dtype), want.view(table.dtype)):
            raise RuntimeError("the kernel's gather differs from the per-layer ops")
        table.scatter(*slots[0], want)
        return table
    except Exception as e:  # noqa: BLE001 - any failure: the per-layer ops still work
        logging.getLogger("vllm.kvedit").warning(
            "kvedit: one-launch paged kernels unavailable (%s); using per-layer ops", e)
        return None


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
