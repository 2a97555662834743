"""Give the memory of a burst back to the OS once the burst is over.

Why: parked lookups (up to --max-parked-keys keys), leases and the L2 write-behind queue (a
write whose chunk L1 evicts meanwhile keeps a copy of its bytes: while Redis is down, a
working set's worth) take memory that the server frees when they end, but glibc keeps freed
heap in the process, so after such a burst the server stays larger for good (docs/protocol.md,
"Observations behind the data path"). A host running the server beside vLLM with hundreds of
GB of KV has none of that to spare. `HeapTrim` watches one estimate of those bytes and calls
glibc's malloc_trim when it has fallen to at most half of its peak since the last trim, by
at least `min_drop` bytes; at most once per `min_interval` seconds, so a client bouncing
around the threshold cannot make the loop trim all the time (a trim is cheap, but not free).
Without glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

try:
    _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):   # not glibc
    _malloc_trim = None


class HeapTrim:
    def __init__(self, min_drop: int = 16 << 20, min_interval: float = 5.0,
                 clock=time.monotonic):
        self.min_drop, self.min_interval, self.clock = min_drop, min_interval, clock
        self.peak = 0
        self.last = -min_interval
        self.trims = 0

    def observe(self, held: int) -> bool:
        """`held`: the estimate now, in bytes. Trims (-> True) when the burst is over."""
        if held > self.peak:
            self.peak = held
            return False
        if self.peak - held < self.min_drop or held > self.peak // 2:
            return False
        now = self.clock()
        if now - self.last < self.min_interval:
            return False
        self.peak, self.last = held, now
        if _malloc_trim is not None:
            _malloc_trim(0)
        self.trims += 1
        return True
