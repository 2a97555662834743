"""Where the rows of one chunk lie inside a [2, L, T, D] KV tensor (the one geometry helper).

Chunk i of kv is kv[:, :, i*C:(i+1)*C]: 2*L rows (K/V x layer) of C*D elements each, every
row contiguous when kv's last two dimensions are (stride(2) == D, stride(3) == 1). rowcopy
copies/compares those rows, chunkmap maps them, the write tracking checks their pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ChunkRows:
    offsets: list[int]  # byte offset of each (K/V, layer) row from the tensor's data_ptr, K first
    row_bytes: int      # bytes per row: C * D * element size


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """A [2, L, T, D] tensor's address, shape and strides (recorded: fn may resize kv)."""
    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    elem: int
    dtype: torch.dtype

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVGeometry:
        return cls(kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.element_size(), kv.dtype)

    def same_place(self, other: KVGeometry) -> bool:
        """Same bytes, same strides and dtype (a prefix slice of kv qualifies)."""
        return (self.ptr, self.stride, self.dtype) == (other.ptr, other.stride, other.dtype)

    def rows(self, i: int, c: int) -> ChunkRows | None:
        """Rows of chunk i (c tokens), or None if the rows are not contiguous."""
        if len(self.shape) != 4 or self.stride[3] != 1 or self.stride[2] != self.shape[3]:
            return None
        s0, s1, s2 = (s * self.elem for s in self.stride[:3])
        first = i * c * s2
        return ChunkRows([first + k * s0 + layer * s1 for k in range(2)
                          for layer in range(self.shape[1])], c * self.shape[3] * self.elem)


def chunk_rows(kv: torch.Tensor, i: int, c: int) -> ChunkRows | None:
    """Rows of chunk i (c tokens) of kv, or None if kv's rows are not contiguous."""
    return KVGeometry.of(kv).rows(i, c)


def contiguous_row_offset(row: int, chunk: int, n_chunks: int, row_bytes: int) -> int:
    """Byte offset of (row, chunk) in a contiguous [2, L, n*C, D] tensor: where chunkmap
    maps row `row` of stored chunk `chunk` (the same place `rows()` reports for it)."""
    return (row * n_chunks + chunk) * row_bytes
