"""Copies between vLLM's paged KV caches and kvedit chunk tensors [2, L, C, D].

Pure torch (no vllm/msgspec import), so the layouts can be tested on any machine.

Every layout we know puts one head's K (or V) of one token in a contiguous run of head_dim
elements ("a row"). A token's row in layer l is at element offset
    base_l + kv*s_kv + block*s_block + head*s_head + pos*s_pos
of the layer's storage, so one index tensor of rows [2, L, T, H] (built with broadcasting,
no Python loop over tokens) turns a whole chunk into ONE `index_select` (store) or ONE
`index_copy_` (load) over a flat [rows, head_dim] view of the storage, when all layers
share one storage; otherwise one per storage.

Layouts (per-layer tensor as vLLM hands it to the connector):
- "cpu"  vLLM CPU backend: [blocks, H, N, 2*hd]; each [block, head] tile is K of the N
         tokens followed by V of the N tokens (the backend views it as [blocks, H, 2N, hd]).
- "cuda" FlashAttention / FlashInfer (vLLM >= 0.2x standardized views): logical
         [blocks, H, N, 2*hd], K = [..., :hd], V = [..., hd:]; any physical stride order
         (NHD or HND) is handled through the strides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("cpu", "cuda")


@dataclass(frozen=True)
class _Geometry:
    s_kv: int
    s_block: int
    s_head: int
    s_pos: int


def _geometry(t: torch.Tensor, kind: str, head_dim: int) -> _Geometry:
    if t.dim() != 4 or t.shape[3] != 2 * head_dim:
        raise ValueError(f"paged KV layer of shape {tuple(t.shape)}: expected "
                         f"[blocks, kv_heads, block_size, 2*head_dim={2 * head_dim}]")
    s0, s1, s2, s3 = t.stride()
    if s3 != 1:
        raise ValueError(f"paged KV layer strides {t.stride()}: last dim must be contiguous")
    if kind == "cuda":
        return _Geometry(s_kv=head_dim, s_block=s0, s_head=s1, s_pos=s2)
    if kind == "cpu":
        n = t.shape[2]
        if s2 != 2 * head_dim or s1 != n * 2 * head_dim:
            raise ValueError(f"CPU paged KV layer strides {t.stride()}: expected contiguous "
                             "[block, head] tiles")
        return _Geometry(s_kv=n * head_dim, s_block=s0, s_head=s1, s_pos=head_dim)
    raise ValueError(f"unknown paged layout {kind!r}; expected one of {LAYOUTS}")


def _rows_view(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[rows, head_dim] over the whole storage behind `t`."""
    n = t.untyped_storage().nbytes() // t.element_size() // head_dim
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    return flat.as_strided((n, head_dim), (head_dim, 1), 0)


class PagedKV:
    """All layers of one vLLM worker's paged KV cache, addressed by token slot."""

    def __init__(self, layers: list[torch.Tensor], kind: str, head_dim: int,
                 block_size: int | None = None):
        if not layers:
            raise ValueError("no KV cache layers")
        self.kind, self.head_dim = kind, head_dim
        self.num_layers = len(layers)
        self.num_heads = layers[0].shape[1]
        self.kernel_block = layers[0].shape[2]  # tokens per block in the tensor
        # vLLM's block ids count scheduler blocks; a backend may split each into several
        # kernel blocks ("virtual block splitting"), so keep the ratio.
        self.block_size = block_size or self.kernel_block
        if self.block_size % self.kernel_block:
            raise ValueError(f"block size {self.block_size} is not a multiple of the kernel "
                             f"block size {self.kernel_block}")
        self.device, self.dtype = layers[0].device, layers[0].dtype
        geos = {_geometry(t, kind, head_dim) for t in layers}
        if len(geos) != 1 or any(t.shape != layers[0].shape or t.dtype != self.dtype
                                 for t in layers):
            raise ValueError("KV cache layers differ in shape, dtype or strides")
        self.geo = geos.pop()
        for name in ("s_kv", "s_block", "s_head", "s_pos"):
            if getattr(self.geo, name) % head_dim:
                raise ValueError(f"stride {name} not a multiple of head_dim: rows would split")
        # Group layers by storage: one flat row view (and one copy op) per storage.
        self.groups: list[tuple[torch.Tensor, list[int], torch.Tensor]] = []
        by_storage: dict[int, list[int]] = {}
        for i, t in enumerate(layers):
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        for idx in by_storage.values():
            if idx != list(range(idx[0], idx[0] + len(idx))):
                raise ValueError(f"layers {idx} share a storage but are not consecutive")
            rows = _rows_view(layers[idx[0]], head_dim)
            bases = torch.tensor([layers[i].storage_offset() for i in idx], dtype=torch.int64)
            if (bases % head_dim).any():
                raise ValueError("layer storage offset not a multiple of head_dim")
            self.groups.append((rows, idx, bases.to(self.device)))
        self.whole = len(self.groups) == 1 and self.groups[0][1] == list(range(len(layers)))
        g = self.geo
        self._kv_off = torch.tensor([0, g.s_kv], dtype=torch.int64, device=self.device)
        self._head_off = torch.arange(self.num_heads, device=self.device) * g.s_head

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    def slots(self, block_ids, start: int, end: int) -> torch.Tensor:
        """Slot (kernel block, position) of each token in [start, end), as two int64 tensors
        stacked [2, T]. block_ids are the request's scheduler block ids."""
        pos = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // self.block_size]
        within = pos % self.block_size
        ratio = self.block_size // self.kernel_block
        kblock = blocks * ratio + within // self.kernel_block
        return torch.stack([kblock, within % self.kernel_block]).to(self.device)

    def _rows(self, slots: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
        """Row indices [2, len(bases), T, H] (K/V, layer, token, head), flattened."""
        g = self.geo
        tok = slots[0] * g.s_block + slots[1] * g.s_pos                      # [T]
        off = (self._kv_off[:, None, None, None] + bases[None, :, None, None]
               + tok[None, None, :, None] + self._head_off[None, None, None, :])
        return (off // self.head_dim).reshape(-1)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the tokens at `slots` into `out` [2, L, T, D] (contiguous, on self.device)."""
        for rows, layers, bases in self.groups:
            idx = self._rows(slots, bases)
            if self.whole:
                torch.index_select(rows, 0, idx, out=out.view(-1, self.head_dim))
                continue
            # Layers in separate storages: K and V of this group are each a contiguous slab.
            idx = idx.view(2, -1)
            for kv in (0, 1):
                dst = out[kv, layers[0]:layers[-1] + 1].view(-1, self.head_dim)
                torch.index_select(rows, 0, idx[kv], out=dst)

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` [2, L, T, D] (on self.device) into the tokens at `slots`."""
        for rows, layers, bases in self.groups:
            idx = self._rows(slots, bases)
            part = src if self.whole else src[:, layers]
            rows.index_copy_(0, idx, part.reshape(-1, self.head_dim))
