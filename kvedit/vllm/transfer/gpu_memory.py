"""GPU memory the connector's copies use: page-locked host mappings, device staging, streams.

- pin_host / unpin_host / HostMapping: page-lock the server's shared memory so copies to and
  from the GPU run as DMA (and unregister it before it is unmapped: see HostMapping);
- StagingRing: a bounded pool of device chunk slots for stores in flight;
- DeviceStreams: side streams and events that overlap the copies with gathers / scatters.
Pure torch; on the CPU every piece degrades to inline copies.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque

import torch

# Host allocation address -> (the tensor over it, registered?). Holding the tensor keeps the
# mapping alive while CUDA has it registered: a server restart makes the client map a new
# segment, and if the old one were unmapped first, the new mapping could land at the same
# address, look registered, and DMA would go to the old segment's pages (stored chunks read
# back as zeros after the GPU suite's server-restart test, on the H200).
_PINNED: dict[int, tuple[torch.Tensor, bool]] = {}
_PIN_LOCK = threading.Lock()


def _cudart_call(fn) -> int:
    """Run one CUDA runtime call in a thread of its own and return its code: a failed call
    leaves a "last error" in its thread, and torch reports that at the thread's next kernel
    launch (seen on the H200: "part or all of the requested memory range is already
    mapped" raised by a gather after a repeated registration)."""
    device = torch.cuda.current_device()
    rc: list[int] = []

    def call():
        torch.cuda.set_device(device)  # the calling thread's device (TP ranks differ)
        rc.append(int(fn(torch.cuda.cudart())))
    t = threading.Thread(target=call, name="kvedit-pin")
    t.start()
    t.join()
    return rc[0] if rc else -1


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock the whole host allocation behind `t` (e.g. the server's shared-memory
    segment) so copies between it and the GPU run as DMA, not through a bounce buffer.
    Returns False if CUDA refuses (the copies still work, just slower). Once per allocation
    per process; it stays mapped and registered until unpin_host."""
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    with _PIN_LOCK:
        if ptr not in _PINNED:
            rc = _cudart_call(lambda rt: rt.cudaHostRegister(ptr, nbytes, 0))
            _PINNED[ptr] = (t, rc == 0)
        return _PINNED[ptr][1]


def unpin_host(t: torch.Tensor) -> None:
    """Undo pin_host (e.g. the server restarted and the client mapped a new segment); the
    old mapping can go once nothing else holds it."""
    ptr = t.untyped_storage().data_ptr()
    with _PIN_LOCK:
        entry = _PINNED.pop(ptr, None)
        if entry is not None and entry[1]:
            _cudart_call(lambda rt: rt.cudaHostUnregister(ptr))


class HostMapping:
    """This process's own mapping of the server's shared-memory file, page-locked once for
    the GPU (pin=True). The connector's DMA copies go through it rather than through the
    client's mapping: the client unmaps its segment when the server restarts, and a
    registered range that gets unmapped and mapped again at the same address still looks
    page-locked to CUDA, whose copies then go to the old segment's pages (on the H200 the
    GPU suite's stores after test_server_outage read back as zeros). This mapping lives
    until close(), which unregisters it first; `current` says whether it still maps the
    file now at its path (a restarted server makes a new file)."""

    def __init__(self, path: str, pin: bool):
        st = os.stat(path)
        self.path, self.ident = path, (st.st_dev, st.st_ino)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        self.bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = pin_host(self.bytes) if pin else False

    def current(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return path == self.path and (st.st_dev, st.st_ino) == self.ident

    def view_of(self, t: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """The bytes of `t` (a contiguous view into the client's mapping `seg` of the same
        file) as a tensor of this mapping."""
        off, nbytes = t.data_ptr() - seg.data_ptr(), t.numel() * t.element_size()
        if not t.is_contiguous() or off < 0 or off + nbytes > self.bytes.numel():
            raise ValueError(f"kvedit: a host tensor of {nbytes} bytes at offset {off} is not "
                             f"a contiguous part of the {self.bytes.numel()}-byte segment")
        return self.bytes[off:off + nbytes].view(t.dtype).view(t.shape)

    def close(self) -> None:
        if self.bytes is None:
            return
        if self.pinned:
            unpin_host(self.bytes)
        self.bytes = None
        try:
            self._mm.close()
        except BufferError:  # views still alive elsewhere: the mapping goes with them
            pass


class StagingRing:
    """A fixed pool of chunk slots [slots, *chunk_shape] on the device, handed out as
    contiguous ranges (so a batch of chunks is one gather target) and given back oldest first
    (the connector drains its store jobs in order). `take` blocks while the pool is full, at
    most `timeout` seconds: the pool bounds the device memory that stores in flight hold."""

    def __init__(self, slots: int, chunk_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        if slots < 1:
            raise ValueError(f"staging ring of {slots} slots; expected at least 1")
        self.capacity = slots
        self.buf = torch.empty((slots, *chunk_shape), dtype=dtype, device=device)
        self._cv = threading.Condition()
        self._live: deque[tuple[int, int]] = deque()  # (start, n) handed out, oldest first
        self._head = 0  # where the next range starts if it fits before the end

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # used: [tail, head); free: [head, cap) and [0, tail)
            if self.capacity - self._head >= n:
                return self._head
            return 0 if tail >= n else None
        return self._head if tail - self._head >= n else None  # wrapped: free [head, tail)

    def take(self, n: int, timeout: float) -> int:
        """Start of a free range of n slots (n <= capacity)."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"{n} chunks for a staging ring of {self.capacity} slots")
        deadline = time.monotonic() + timeout
        with self._cv:
            while (start := self._fit(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kvedit: GPU staging full ({self.capacity} chunks in "
                                       f"flight to the server for {timeout:.0f} s)")
                self._cv.wait(left)
            self._live.append((start, n))
            self._head = start + n
            return start

    def give(self, start: int, n: int) -> None:
        """Hand back the oldest range (it must be the one at `start`)."""
        with self._cv:
            if not self._live or self._live[0] != (start, n):
                raise RuntimeError(f"staging range ({start}, {n}) given back out of order; "
                                   f"oldest is {self._live[0] if self._live else None}")
            self._live.popleft()
            if not self._live:
                self._head = 0
            self._cv.notify_all()

    @property
    def in_use(self) -> int:
        with self._cv:
            return sum(n for _, n in self._live)


def default_staging_bytes(device: torch.device) -> int:
    """Device memory for the connector's staging (3/4 store ring, 1/4 load halves): 2 GiB,
    or 1/32 of a smaller GPU's memory. vLLM does not count it in its own budget, so it
    stays well inside what --gpu-memory-utilization leaves free (0.1 of the GPU by
    default)."""
    if device.type != "cuda":
        return 256 << 20
    total = torch.cuda.get_device_properties(device).total_memory
    return min(2 << 30, total // 32)


class DeviceStreams:
    """Side streams and events for the connector's pipelined copies on CUDA: device->host
    copies of stores on one stream, host->device copies of loads on another, ordered against
    the gathers / scatters on the current stream by events. On the CPU every copy runs
    inline and there is nothing to order."""

    def __init__(self, device: torch.device, device_wait: bool = False):
        self.device, self.cuda = device, device.type == "cuda"
        self.device_wait = self.cuda and device_wait  # the whole device, not only our copies
        if self.cuda:
            self.load_stream = torch.cuda.Stream(device)
            self.store_stream = torch.cuda.Stream(device)
        self._free: list = [None, None]  # per load staging half: after its last scatter

    def bind_thread(self) -> None:
        """A thread that queues copies on this device (the background store thread)."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def mark_current(self):
        """An event after the work queued so far on the current stream (the forward's: vLLM
        sets its stream with torch.cuda.set_stream, in this thread), or None on the CPU."""
        if not self.cuda:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def wait_device(self) -> None:
        """device_wait: block until every stream on the device is idle (the forward's KV
        writes, on whatever stream vLLM ran them); nothing otherwise."""
        if self.device_wait:
            torch.cuda.synchronize(self.device)

    def wait_event(self, event) -> None:
        """device_wait: block until `event` (mark_current's) happened; nothing otherwise."""
        if self.device_wait and event is not None:
            event.synchronize()

    def store_after(self, event) -> None:
        """Store copies queued from now on wait for `event` (mark_current's); the host does
        not wait."""
        if event is not None:
            self.store_stream.wait_event(event)

    def load_done(self) -> None:
        """Block until every queued host->device load copy landed (the scatters reading the
        staging are ordered after them on the current stream; the host source may go);
        device_wait: until the whole device is idle, the scatters included."""
        if self.device_wait:
            self.wait_device()
        elif self.cuda:
            self.load_stream.synchronize()

    def load_copy(self, dst: torch.Tensor, srcs: list[torch.Tensor], half: int) -> None:
        """Host chunks -> dst (staging half `half`), after that half's previous scatter; the
        current stream waits for the copies before anything queued after this call."""
        if not self.cuda:
            for d, s in zip(dst, srcs):
                d.copy_(s)
            return
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.load_stream):
            if self._free[half] is not None:
                self.load_stream.wait_event(self._free[half])
            for d, s in zip(dst, srcs):
                d.copy_(s, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.load_stream)
        current.wait_event(ready)

    def scattered(self, half: int) -> None:
        """The scatter from staging half `half` is queued: its next copy waits for it."""
        if self.cuda:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
            self._free[half] = free

    def store_after_current(self) -> None:
        """Store copies queued from now on wait for the work queued so far on the current
        stream (a gather into staging); the host does not wait."""
        if self.cuda:
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(self.device))
            self.store_stream.wait_event(gathered)

    def store_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device staging -> host slot, queued on the store stream (or inline on the CPU)."""
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.store_stream):
            dst.copy_(src, non_blocking=True)

    def store_done(self) -> None:
        """Block until every queued store copy landed."""
        if self.cuda:
            self.store_stream.synchronize()
