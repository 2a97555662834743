"""fn's output tensors on kvedit's own reused pages: the `new_kv` an edit fn may declare.

An edit that builds a new tensor (`torch.cat` of the kept parts, an `index_select`) gets it
from the process's malloc, which serves a block of 100+ MB with a fresh mmap and unmaps it
on free: every modify faults in (and the kernel zeroes) every page of its output again, at a
page fault per 4 KiB. kvedit does not change the process's malloc to avoid that; it lends fn
memory of its own instead. `new_kv(shape_or_like, dtype=None)` returns an uninitialised
tensor on pages the context keeps (kvedit.sdk.buffers: anonymous mappings, huge pages where
the kernel grants them) and hands out again in later modifies, so from the second modify on
fn writes into touched memory:

    def drop_half(kv, tokens, layout, new_kv):
        keep = ...
        out = new_kv((2, kv.shape[1], len(keep_tokens), kv.shape[3]))   # or new_kv(like)
        torch.cat([kv[:, :, :q], kv[:, :, -q:]], dim=2, out=out)
        return out, keep_tokens

The pages go back to the context's pool once modify has stored the edit and nothing else
uses them (a tensor or view fn or the caller keeps is never handed out again while it
lives). The pool keeps at most `modify_concurrency` buffers, the largest seen, until
`close()` (or `ctx.outputs.clear()`); that memory is the cost.
"""
from __future__ import annotations

import math
import threading

import torch

from kvedit.sdk.buffers import BufferPool, KVBuffer


class NewKV:
    """One stream's `new_kv` for one modify: takes buffers from the context's output pool
    and gives every one back at `give_back()` (modify calls it after the store)."""

    def __init__(self, pool: BufferPool, dtype: torch.dtype):
        self._pool, self._dtype = pool, dtype
        self._taken: list[KVBuffer] = []
        self._lock = threading.Lock()   # fn may call it from several threads

    def __call__(self, shape_or_like, dtype: torch.dtype | None = None) -> torch.Tensor:
        if isinstance(shape_or_like, torch.Tensor):
            shape = tuple(shape_or_like.shape)
            dtype = dtype or shape_or_like.dtype
        else:
            try:
                if isinstance(shape_or_like, (str, bytes)):
                    raise TypeError
                shape = tuple(int(n) for n in shape_or_like)
            except (TypeError, ValueError):
                raise TypeError(f"new_kv takes a shape (a sequence of ints) or a tensor to "
                                f"match, got {type(shape_or_like).__name__}") from None
        if any(n < 0 for n in shape):
            raise ValueError(f"new_kv: negative dimension in shape {shape}")
        dtype = dtype or self._dtype
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        buf = self._pool.take(nbytes)
        with self._lock:
            self._taken.append(buf)
        return buf.open(cow=False)[:nbytes].view(dtype).view(shape)

    def give_back(self) -> None:
        """modify is done with what fn built: the buffers are reused once unused."""
        with self._lock:
            taken, self._taken = self._taken, []
        for buf in taken:
            self._pool.give(buf)
