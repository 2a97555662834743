"""Byte moves between chunk k of a [2, L, T, D] tensor and a contiguous [2, L, C, D] chunk.

Chunk i of kv is kv[:, :, i*C:(i+1)*C]: 2*L contiguous rows of C*D elements. libc's
memcpy/memcmp over those rows (ctypes releases the GIL) ran at memcpy speed here, where
torch.stack into the strided view reached about 55% and per-chunk copy_ about 80% of it,
and torch.equal / np.array_equal compared at 0.3-0.8x memcpy. Tensors whose rows are not
contiguous (an fn may return any strides) fall back to torch.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

try:
    _libc = ctypes.CDLL(None)
    _memcpy, _memcmp = _libc.memcpy, _libc.memcmp
    _memcpy.restype, _memcmp.restype = ctypes.c_void_p, ctypes.c_int
    _memcpy.argtypes = _memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
except (OSError, AttributeError):  # no libc symbols in this process: torch/numpy fallback
    _memcpy = _memcmp = None


def _rows(kv: torch.Tensor, i: int, c: int):
    """(row pointers of chunk i, row bytes) if its rows are contiguous, else None."""
    if _memcpy is None or kv.stride(3) != 1 or kv.stride(2) != kv.shape[3]:
        return None
    es = kv.element_size()
    base = kv.data_ptr() + i * c * kv.stride(2) * es
    s0, s1 = kv.stride(0) * es, kv.stride(1) * es
    return [base + k * s0 + layer * s1 for k in range(2) for layer in range(kv.shape[1])], \
        c * kv.shape[3] * es


def _contiguous_ptr(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.is_contiguous() else None


def load_chunk(kv: torch.Tensor, i: int, chunk: torch.Tensor) -> None:
    """kv[:, :, i*C:(i+1)*C] = chunk."""
    c = chunk.shape[2]
    rows, src = _rows(kv, i, c), _contiguous_ptr(chunk)
    if rows is None or src is None:
        kv[:, :, i * c:(i + 1) * c].copy_(chunk)
        return
    ptrs, n = rows
    for j, dst in enumerate(ptrs):
        _memcpy(dst, src + j * n, n)


def save_chunk(buf: torch.Tensor, kv: torch.Tensor, i: int) -> None:
    """buf = kv[:, :, i*C:(i+1)*C] (buf contiguous, e.g. a shm slot)."""
    c = buf.shape[2]
    rows, dst = _rows(kv, i, c), _contiguous_ptr(buf)
    if rows is None or dst is None:
        buf.copy_(kv[:, :, i * c:(i + 1) * c])
        return
    ptrs, n = rows
    for j, src in enumerate(ptrs):
        _memcpy(dst + j * n, src, n)


def chunk_equal(kv: torch.Tensor, i: int, chunk: torch.Tensor) -> bool:
    """Is kv[:, :, i*C:(i+1)*C] byte-identical to chunk?"""
    c = chunk.shape[2]
    rows, other = _rows(kv, i, c), _contiguous_ptr(chunk)
    if rows is None or other is None:
        a = kv[:, :, i * c:(i + 1) * c].contiguous().view(torch.uint8).numpy()
        return np.array_equal(a, chunk.contiguous().view(torch.uint8).numpy())
    ptrs, n = rows
    return all(_memcmp(p, other + j * n, n) == 0 for j, p in enumerate(ptrs))
