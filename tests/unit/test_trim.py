"""HeapTrim (kvedit/server/trim.py): trims once a burst is over, not while it lasts, and at most
once per interval (a fake clock; the trim itself is glibc's and is not observed here)."""
from kvedit.server.trim import HeapTrim

MB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trims_after_the_burst_and_not_during_it():
    clock = Clock()
    trim = HeapTrim(min_drop=16 * MB, min_interval=5.0, clock=clock)
    assert not any(trim.observe(n * MB) for n in (10, 40, 80, 70, 41))   # above half the peak
    assert trim.observe(30 * MB) and trim.trims == 1
    assert not trim.observe(0)            # a new peak of 30 MB: dropping 30 is enough, but
    clock.t += 5.0                        # only after min_interval
    assert trim.observe(0) and trim.trims == 2


def test_small_drops_do_not_trim():
    trim = HeapTrim(min_drop=16 * MB, min_interval=0.0, clock=Clock())
    assert not trim.observe(10 * MB) and not trim.observe(0)   # 10 MB < min_drop
    assert trim.trims == 0
