"""What KVClient calls hand back: errors, store handles and retrieved chunks."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvedit import protocol as P
from kvedit.layout import ModelLayout

if TYPE_CHECKING:
    from kvedit.client import KVClient


class KVError(Exception):
    """An error reply (or a client-side check): .code names the kind, the message the detail."""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


class ServerUnavailable(KVError):
    """No reply from the server within the timeout."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    stored: int    # chunks written by this call
    present: int   # chunks already in the server (or being written by another store)


class StoreHandle:
    """Slots for the missing keys of a prepare_store: fill .buffers, then commit() or abort()."""

    def __init__(self, client: KVClient, slots: P.StoreSlots, buffers: list[torch.Tensor]):
        self._client, self._slots, self._done = client, slots, False
        self.missing: list[int] = slots.missing
        self.present: int = slots.present
        self.layout: ModelLayout = slots.layout
        self.buffers = buffers

    def commit(self, data: list[torch.Tensor] | None = None) -> StoreResult:
        """Publish the data (socket mode first sends `data`, or the staging buffers)."""
        if self._done:
            raise KVError("closed", "this store was already committed or aborted")
        self._done = True
        if self._client.transfer_mode == "socket" and self.missing:
            try:
                self._client._link.put(self._slots.store_id, self.buffers if data is None else data)
            except BaseException:
                self._done = False
                self.abort()
                raise
        reply = self._client._call(P.Commit(store_id=self._slots.store_id))
        return StoreResult(stored=reply.stored, present=self.present)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._client._call(P.Abort(store_id=self._slots.store_id))
            except KVError as e:
                # gone already (TTL), or a broken data-link PUT still winding down on the
                # server: either way the write TTL reclaims the slots
                if e.code not in ("unknown_store", "busy"):
                    raise

    def __enter__(self) -> StoreHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._done:
                self.commit()
        else:
            self.abort()


class Retrieved:
    """Tensors of the leading present keys; in shm mode zero-copy views valid until release()."""

    def __init__(self, client: KVClient, tensors: list[torch.Tensor], lease_id: int | None,
                 recycle: list[torch.Tensor] = ()):
        self._client, self._lease, self._recycle = client, lease_id, list(recycle)
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def release(self) -> None:
        if self._recycle:  # socket mode: the receive buffers go back to the client's pool
            self._client.recv_pool.give(self._recycle)
            self._recycle = []
        if self._lease is not None:
            lid, self._lease = self._lease, None
            self._client._call(P.Release(lease_id=lid))

    def __enter__(self) -> Retrieved:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RecvPool:
    """Socket-mode receive buffers, reused after Retrieved.release().

    Receiving into fresh memory costs a page fault per 4 KiB, which held socket retrieves to
    ~0.3x of raw TCP; reused buffers are already mapped. Keeps at most `cap` idle bytes.
    """

    def __init__(self, cap: int):
        self.cap, self.idle = cap, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                self.idle -= nbytes
                return bufs.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                if self.idle + b.numel() <= self.cap:
                    self._free.setdefault(b.numel(), []).append(b)
                    self.idle += b.numel()


