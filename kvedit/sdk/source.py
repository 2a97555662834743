"""Where modify's kv comes from: one small protocol, two implementations, chosen once.

`open_kv(ctx, per_rank)` returns a KVSource: `kv` (the [2, L, T, D] tensor fn gets), the pages
fn wrote, which chunks fn handed back untouched, a lease check before commit, `close()`
(cheap: hands back what the next stream's edit reuses, so modify calls it while the stream
still holds its CPU slot) and `release()` (what only this edit used, an unmapping of 5-10 ms:
modify calls it once the slot is free for the next stream).
- MappedKV (kvedit.sdk.chunkmap): shm mode with write tracking, one rank; kv is the stored
  chunks themselves, mapped copy-on-write (no copy).
- CopiedKV (here): one row-wise copy into a pooled buffer (kvedit.sdk.buffers), tracked
  through a memfd's private mapping where the OS allows it, plain memory otherwise. Under
  tensor parallel every rank's chunks are copied into their heads' columns of that buffer
  (replicated heads read once, from the first rank holding them): kv holds every KV head in
  the model's order (kvedit.sdk.tp), and the write tracking works for it as for one rank.
modify never asks which one it has, nor how many ranks there are.
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


def open_kv(ctx, per_rank: list[list[bytes]]) -> tuple[KVSource, torch.Tensor]:
    """(source, kv): the chunks of `per_rank` (each rank's keys of the same chunks, index =
    rank) as one contiguous [2, L, N*C, D] tensor laid out as ctx.fn_layout."""
    lay = ctx.fn_layout
    n = len(per_rank[0])
    shape, dtype = (2, lay.num_layers, n * lay.chunk_size, lay.hidden), getattr(torch, lay.dtype)
    cow = ctx.pool.use_cow()
    if cow and len(per_rank) == 1 \
            and (mapped := map_chunks(ctx.client, ctx.model, per_rank[0], lay)) is not None:
        return mapped, mapped.view.view(dtype).view(shape)
    buf = ctx.pool.take(n * lay.chunk_bytes)
    target = buf.target[:n * lay.chunk_bytes].view(dtype).view(shape)
    for r, cols in ctx.columns():   # one rank: all of it; TP: each head group's columns
        with ctx.client.retrieve(ctx.model, per_rank[r], tp_rank=r) as got:
            if len(got.tensors) < n:
                where = f" on tensor-parallel rank {r}" if len(per_rank) > 1 else ""
                raise LookupError(f"only {len(got.tensors)} of its {n} chunks could be "
                                  f"retrieved{where} (evicted meanwhile?)")
            for i, chunk in enumerate(got.tensors):
                load_chunk(target[..., cols], i, chunk)
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
