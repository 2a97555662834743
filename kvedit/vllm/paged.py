"""Copies between vLLM's paged KV caches and kvedit chunk tensors [2, L, C, D].

Pure torch (no vllm/msgspec import), so the layouts can be tested on any machine.

Each layout says where K (and V) of one head of one token sits inside vLLM's per-layer
tensor [blocks, H, N, 2*hd], as strides: the in-block position n and the head dim d may be
split into factors (CPU AMX tiles interleave them). From those strides we build one strided
view per K/V covering every layer — [L, blocks, *n_factors, H, *d_factors] — and a whole
chunk moves in ONE advanced-indexing op per K/V: a gather (`aten.index` written straight
into the destination, e.g. the server's shared memory) or a scatter (`index_put_`), with
index tensors of length T. No Python loop over tokens, blocks or layers.

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

LAYOUTS = ("cuda", "cpu", "cpu_amx")

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
                 block_size: int | None = None):
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
        start = 0
        while start < len(layers):
            end = start + 1
            while end < len(layers) and _same_run(layers, start, end):
                end += 1
            self.groups.append((start, end, self._views(layers[start:end])))
            start = end

    def _views(self, run: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        t = run[0]
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        s_layer = run[1].storage_offset() - t.storage_offset() if len(run) > 1 else 0
        views = []
        for side in self.sides:
            sizes = [len(run), t.shape[0], *(f[0] for f in side.pos), t.shape[1],
                     *(f[0] for f in side.dim)]
            strides = [s_layer, t.stride(0), *(f[1] for f in side.pos), t.stride(1),
                       *(f[1] for f in side.dim)]
            views.append(flat.as_strided(sizes, strides, t.storage_offset() + side.offset))
        return views[0], views[1]

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    def slots(self, block_ids, start: int, end: int) -> tuple[list[torch.Tensor], ...]:
        """Index tensors of the tokens in [start, end) for K and for V: (kernel block,
        *position factors), given the request's scheduler block ids."""
        pos = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // self.block_size]
        within = pos % self.block_size
        kblock = blocks * (self.block_size // self.kernel_block) + within // self.kernel_block
        kblock, n = kblock.to(self.device), (within % self.kernel_block).to(self.device)
        out = []
        for side in self.sides:
            factors, rest = [], n
            for size, _ in reversed(side.pos):  # mixed radix, minor factor first
                factors.append(rest % size)
                rest = rest // size
            out.append([kblock, *reversed(factors)])
        return tuple(out)

    def _split(self, t: torch.Tensor, kv: int) -> torch.Tensor:
        """[L', T, D] -> [L', T, H, *dim factors] (a view)."""
        return t.unflatten(-1, (self.num_heads, *(f[0] for f in self.sides[kv].dim)))

    def gather(self, slots: tuple[list[torch.Tensor], ...], out: torch.Tensor) -> None:
        """Copy the tokens at `slots` into `out` [2, L, T, D] (contiguous, on self.device)."""
        for lo, hi, views in self.groups:
            for kv in (0, 1):
                torch.ops.aten.index.Tensor_out(views[kv], [None, *slots[kv]],
                                                out=self._split(out[kv, lo:hi], kv))

    def scatter(self, slots: tuple[list[torch.Tensor], ...], src: torch.Tensor) -> None:
        """Copy `src` [2, L, T, D] (on self.device) into the tokens at `slots`."""
        for lo, hi, views in self.groups:
            for kv in (0, 1):
                torch.ops.aten.index_put_(views[kv], [None, *slots[kv]],
                                          self._split(src[kv, lo:hi], kv))


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


def _same_run(layers: list[torch.Tensor], start: int, end: int) -> bool:
    """Does layer `end` continue the uniform-stride run of layers[start:end] in one storage?"""
    a, b = layers[start], layers[end]
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    step = layers[start + 1].storage_offset() - a.storage_offset() if end > start + 1 else None
    gap = b.storage_offset() - layers[end - 1].storage_offset()
    return gap > 0 and (step is None or gap == step)


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock the whole host allocation behind `t` (e.g. the server's shared-memory
    segment) so copies between it and the GPU run as DMA, not through a bounce buffer.
    Returns False if CUDA refuses (the copies still work, just slower)."""
    storage = t.untyped_storage()
    rc = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
    return int(rc) == 0
