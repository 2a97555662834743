"""Where modify's kv comes from: one small protocol, two implementations, chosen once.

`open_kv(ctx, keys)` returns a KVSource: `kv` (the [2, L, T, D] tensor fn gets), the pages fn
wrote, which chunks fn handed back untouched, a lease check before commit, `close()` (cheap:
hands back what the next stream's edit reuses, so modify calls it while the stream still
holds its CPU slot) and `release()` (what only this edit used, an unmapping of 5-10 ms:
modify calls it once the slot is free for the next stream).
- MappedKV (kvedit.sdk.chunkmap): shm mode with write tracking; kv is the stored chunks
  themselves, mapped copy-on-write (no copy).
- CopiedKV (here): one row-wise copy into a pooled buffer (kvedit.sdk.buffers), tracked
  through a memfd's private mapping where the OS allows it, plain memory otherwise.
modify never asks which one it has.
"""
from __future__ import annotations

import mmap
from typing import Protocol

import numpy as np
import torch

from kvedit.sdk.buffers import BufferPool, KVBuffer
from kvedit.sdk.chunkmap import map_chunks
from kvedit.sdk.geometry import KVGeometry
from kvedit.sdk.rowcopy import load_chunk


class KVSource(Protocol):
    spares_copy: float  # credit for BufferPool.note_outcome: 0 unless no copy was made

    def written_pages(self) -> np.ndarray | None:
        """Per page of kv's bytes: written by fn? None when not tracked."""

    def check_lease(self) -> None:
        """Raise KVError("lease_expired") if kv's bytes may no longer be the chunks'."""

    def close(self) -> None:
        """modify is done with kv: hand back what the next edit reuses (a pooled buffer;
        fn may still hold kv: then it is reused after its last user). Cheap."""

    def release(self) -> None:
        """After close: let go of what only this edit used (a mapping and its read lease;
        freed with fn's last reference if fn kept kv). May take milliseconds."""


class CopiedKV:
    """kv copied out of the server into a pooled (reused, possibly tracked) buffer."""

    spares_copy = 0.0

    def __init__(self, pool: BufferPool, buf: KVBuffer):
        self._pool, self._buf = pool, buf

    def written_pages(self) -> np.ndarray | None:
        return self._buf.written_pages()

    def check_lease(self) -> None:
        """The bytes were copied under the lease (the retrieve checked it): nothing to do."""

    def close(self) -> None:
        self._pool.give(self._buf)

    def release(self) -> None:
        """Nothing left: the buffer went back to the pool at close()."""


def open_kv(ctx, keys: list[bytes]) -> tuple[KVSource, torch.Tensor]:
    """(source, kv): the chunks of `keys` as one contiguous [2, L, N*C, D] tensor."""
    lay = ctx.layout
    n = len(keys)
    shape, dtype = (2, lay.num_layers, n * lay.chunk_size, lay.hidden), getattr(torch, lay.dtype)
    cow = ctx.pool.use_cow()
    if cow and (mapped := map_chunks(ctx.client, ctx.model, keys, lay)) is not None:
        return mapped, mapped.view.view(dtype).view(shape)
    buf = ctx.pool.take(n * lay.chunk_bytes)
    with ctx.client.retrieve(ctx.model, keys) as got:
        if len(got.tensors) < n:
            raise LookupError(f"only {len(got.tensors)} of its {n} chunks could be retrieved "
                              f"(evicted meanwhile?)")
        target = buf.target[:n * lay.chunk_bytes].view(dtype).view(shape)
        for i, chunk in enumerate(got.tensors):
            load_chunk(target, i, chunk)
    return CopiedKV(ctx.pool, buf), buf.open(cow)[:n * lay.chunk_bytes].view(dtype).view(shape)


def untouched_chunks(written: np.ndarray | None, given: KVGeometry, returned: torch.Tensor,
                     idx, c: int) -> set[int]:
    """The chunks j in idx that `returned` holds exactly where the kv fn was `given` had
    them, and in which no page was written (`written`: the source's written_pages())."""
    if written is None or not idx or not given.same_place(KVGeometry.of(returned)):
        return set()
    counts = np.concatenate(([0], np.cumsum(written)))
    page, same = mmap.PAGESIZE, set()
    for j in idx:
        rows = given.rows(j, c)
        if rows is None:
            return set()
        lo = np.array(rows.offsets) // page
        hi = (np.array(rows.offsets) + rows.row_bytes - 1) // page
        if not (counts[hi + 1] - counts[lo]).any():
            same.add(j)
    return same
