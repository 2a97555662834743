"""Keys whose store is in flight: what the scheduler side waits for before answering a lookup.

With the background commit (connector setting `async_store`), a step's chunks reach the server
tens of milliseconds after vLLM has returned the step's output, so a request sent right after a
response could look its prefix up before it lands and recompute it. The scheduler side records
here every key it hands to the workers to store; when the server's answer for a new request
stops at a key still recorded, it tells vLLM "cannot tell yet" (None: vLLM asks again at its
next step) instead of a short hit. An entry lasts until the server holds the key or its
deadline passes, whichever is first, so a stuck or failed store delays a request by at most
`wait_s`; the table is bounded (the oldest entries go first: those keys are then answered as
today, a miss at worst).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class InFlightStats:
    recorded: int = 0    # keys handed to a store
    deferred: int = 0    # lookups answered "cannot tell yet"
    expired: int = 0     # entries whose deadline passed before the server held the key
    overflowed: int = 0  # entries dropped because the table was full


class InFlightKeys:
    """Keys handed to the workers to store, each with a deadline (monotonic seconds)."""

    def __init__(self, wait_s: float, max_keys: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic):
        if not wait_s >= 0:  # also refuses NaN
            raise ValueError(f"kvedit connector: store_wait_s {wait_s!r}; expected seconds >= 0")
        self.wait_s, self.max_keys, self.clock = float(wait_s), int(max_keys), clock
        self._deadline: OrderedDict[bytes, float] = OrderedDict()  # oldest deadline first
        self.stats = InFlightStats()

    def __len__(self) -> int:
        return len(self._deadline)

    def add(self, keys: Iterable[bytes]) -> None:
        """`keys` are being stored from now on."""
        if self.wait_s <= 0:
            return
        deadline = self.clock() + self.wait_s
        for key in keys:
            self._deadline.pop(key, None)  # re-stored: its deadline moves to the end
            self._deadline[key] = deadline
            self.stats.recorded += 1
        while len(self._deadline) > self.max_keys:
            self._deadline.popitem(last=False)
            self.stats.overflowed += 1

    def pending(self, key: bytes) -> bool:
        """Whether `key`'s store may still land (recorded, deadline not passed)."""
        self.expire()
        return key in self._deadline

    def discard(self, keys: Iterable[bytes]) -> None:
        """The server holds `keys`, or they will never be stored: stop waiting for them."""
        for key in keys:
            self._deadline.pop(key, None)

    def expire(self) -> None:
        now = self.clock()
        while self._deadline:
            key, deadline = next(iter(self._deadline.items()))
            if deadline > now:
                break
            del self._deadline[key]
            self.stats.expired += 1
