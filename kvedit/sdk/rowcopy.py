"""Byte moves between chunk i of a [2, L, T, D] tensor and a contiguous [2, L, C, D] chunk.

Chunk i of kv is 2*L contiguous rows of C*D elements (kvedit.sdk.geometry). libc's
memcpy/memcmp over those rows (ctypes releases the GIL) run at memcpy speed, where torch's
strided copies and comparisons do not (docs/sdk.md, "Observations behind modify's design").
Tensors whose rows are not contiguous (an fn may return any strides) fall back to torch.
"""
from __future__ import annotations

import numpy as np
import torch

from kvedit.sdk import libc
from kvedit.sdk.geometry import chunk_rows


def _rows(kv: torch.Tensor, i: int, c: int, other: torch.Tensor):
    """(row pointers of chunk i of kv, row bytes, other's pointer) for the libc path, or None
    when libc is missing or either side is not laid out in contiguous rows."""
    if libc.memcpy is None or libc.memcmp is None or not other.is_contiguous():
        return None
    rows = chunk_rows(kv, i, c)
    if rows is None:
        return None
    base = kv.data_ptr()
    return [base + o for o in rows.offsets], rows.row_bytes, other.data_ptr()


def load_chunk(kv: torch.Tensor, i: int, chunk: torch.Tensor) -> None:
    """kv[:, :, i*C:(i+1)*C] = chunk."""
    c = chunk.shape[2]
    if (r := _rows(kv, i, c, chunk)) is None:
        kv[:, :, i * c:(i + 1) * c].copy_(chunk)
        return
    ptrs, n, src = r
    for j, dst in enumerate(ptrs):
        libc.memcpy(dst, src + j * n, n)


def save_chunk(buf: torch.Tensor, kv: torch.Tensor, i: int) -> None:
    """buf = kv[:, :, i*C:(i+1)*C] (buf contiguous, e.g. a shm slot)."""
    c = buf.shape[2]
    if (r := _rows(kv, i, c, buf)) is None:
        buf.copy_(kv[:, :, i * c:(i + 1) * c])
        return
    ptrs, n, dst = r
    for j, src in enumerate(ptrs):
        libc.memcpy(dst + j * n, src, n)


def chunk_equal(kv: torch.Tensor, i: int, chunk: torch.Tensor) -> bool:
    """Is kv[:, :, i*C:(i+1)*C] byte-identical to chunk?"""
    c = chunk.shape[2]
    if (r := _rows(kv, i, c, chunk)) is None:
        a = kv[:, :, i * c:(i + 1) * c].contiguous().view(torch.uint8).numpy()
        return np.array_equal(a, chunk.contiguous().view(torch.uint8).numpy())
    ptrs, n, other = r
    return all(libc.memcmp(p, other + j * n, n) == 0 for j, p in enumerate(ptrs))
