"""What KVClient calls hand back: errors, store handles and retrieved chunks.

Both talk to the client only through its narrow public methods (commit_store, abort_store,
release_lease) and to the transport through its interface (kvedit.client.transport), never to
private state, so neither knows whether bytes moved through shared memory or a socket.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvedit import protocol as P
from kvedit.layout import ModelLayout

if TYPE_CHECKING:
    from kvedit.client.kv_client import KVClient
    from kvedit.client.transport import Transport


class KVError(Exception):
    """An error reply (or a client-side check): .code names the kind, the message the detail."""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


class ServerUnavailable(KVError):
    """No reply from the server within the timeout."""


def ttl_margin(ttl: float) -> float:
    """Safety margin kept before a server TTL: a copy started just before the client-side
    deadline must finish before the server's own (later-starting) clock runs out."""
    return min(5.0, max(0.1, 0.1 * ttl), 0.5 * ttl)


@dataclass(frozen=True, slots=True)
class StoreResult:
    stored: int    # chunks written by this call
    present: int   # chunks already in the server (or being written by another store)


class StoreHandle:
    """Slots for the missing keys of a prepare_store: fill them, then commit() or abort().

    Fill with `write(chunks)` (one chunk per missing key, in order), or copy into the
    tensors of `writable()`, which checks the store's deadline before handing out each one:
    past it (the server's write TTL minus a margin) the slot may be reclaimed, and a write
    raises KVError("store_expired") instead of landing late. `buffers` are the raw targets.
    """

    def __init__(self, client: KVClient, transport: Transport, slots: P.StoreSlots,
                 deadline: float):
        self._client, self._transport = client, transport
        self.store_id: int = slots.store_id
        self.missing: list[int] = slots.missing
        self.present: int = slots.present
        self.layout: ModelLayout = slots.layout
        self.deadline = deadline  # time.monotonic() after which writing is refused
        self._slots, self._buffers = slots, None
        self.sent = False   # socket transport: the bytes are on the server already
        self.done = False   # committed or aborted

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The targets of the missing chunks (slot views, or socket staging tensors made on
        first use: a store that sends its chunks directly never allocates them)."""
        if self._buffers is None:
            self._buffers = self._transport.store_buffers(self._slots)
        return self._buffers

    def check_deadline(self) -> None:
        if time.monotonic() >= self.deadline:
            raise KVError("store_expired", f"store {self.store_id} is past the server's write "
                                           f"TTL (minus a safety margin): not writing into its "
                                           f"slots; prepare the store again")

    def writable(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(key index, target tensor) for each missing key, the deadline checked before each."""
        for i, buf in zip(self.missing, self.buffers):
            self.check_deadline()
            yield i, buf

    def write(self, chunks: list[torch.Tensor]) -> None:
        """Put `chunks` (one per missing key, in order) in place."""
        if self.done:
            raise KVError("closed", "this store was already committed or aborted")
        self._transport.write(self, list(chunks))

    def commit(self, data: list[torch.Tensor] | None = None) -> StoreResult:
        """Publish the filled slots (or first `write(data)`); aborts the store on failure."""
        if self.done:
            raise KVError("closed", "this store was already committed or aborted")
        try:
            if data is not None:
                self._transport.write(self, list(data))
            self._transport.publish(self)
        except BaseException:
            self.abort()
            raise
        self.done = True
        stored = self._client.commit_store(self.store_id)
        return StoreResult(stored=stored, present=self.present)

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._client.abort_store(self.store_id)

    def __enter__(self) -> StoreHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self.done:
                self.commit()
        else:
            self.abort()


class Retrieved:
    """Tensors of the leading present keys; zero-copy views (shared memory) or receive
    buffers (socket), valid until release(); `offsets` / `segment` say where the views lie.
    release() raises KVError("lease_expired") when the server says the lease ran out first:
    then the bytes read may not be the keys' bytes."""

    def __init__(self, tensors: list[torch.Tensor], release: Callable[[], None] | None,
                 deadline: float | None, *, offsets: list[int] | None = None,
                 segment: str | None = None):
        self.tensors = tensors
        self._release = release
        self.deadline = deadline  # monotonic; None: the bytes are ours (no lease to outlive)
        # Shared memory: each chunk's byte offset in the segment file `segment` (the slot
        # offsets the server's Leased reply carries), so a caller can map the chunks itself
        # (kvedit.sdk.chunkmap). None over the socket or when the transport did not say.
        self.offsets = offsets
        self.segment = segment

    def __len__(self) -> int:
        return len(self.tensors)

    def spread(self, asked: list[bytes], keys: list[bytes]) -> Retrieved:
        """This lease of `asked` (each key once) as the answer to `keys` (with repeats): a
        repeated key gets its first chunk again, up to the first key not leased. A data-link
        lease ends at its first repeated key (a GET sends each chunk once), so the client asks
        for each once and both transports answer a retrieve alike."""
        where = {k: i for i, k in enumerate(asked)}
        n = next((j for j, k in enumerate(keys) if where[k] >= len(self.tensors)), len(keys))
        self.tensors = [self.tensors[where[k]] for k in keys[:n]]
        if self.offsets is not None:
            self.offsets = [self.offsets[where[k]] for k in keys[:n]]
        return self

    def expired(self) -> bool:
        """Has the lease (client-side estimate, with a margin) run out?"""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check_lease(self) -> None:
        if self.expired():
            raise KVError("lease_expired", "the read lease is past the server's lease TTL (minus "
                                           "a safety margin): the bytes read may not be the keys'")

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Retrieved:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RecvPool:
    """Socket-mode receive buffers, reused after Retrieved.release().

    Receiving into fresh memory costs a page fault per 4 KiB (docs/protocol.md, "Observations
    behind the data path"); reused buffers are already mapped. Keeps at most `cap` idle bytes.
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
