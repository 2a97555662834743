"""libc through ctypes, loaded once for the SDK: memcpy/memcmp (rowcopy), mmap/munmap
(chunkmap) and mallopt/malloc/free (the opt-in allocator tuning, kvedit.sdk.glibc_tuning;
never called otherwise). ctypes releases the GIL around each call.
Every name is None where this process has no such symbol; callers then use torch/numpy or
skip the optimisation."""
from __future__ import annotations

import ctypes

memcpy = memcmp = mmap = munmap = mallopt = malloc = free = None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - no dynamic libc (static or exotic platform)
    _libc = None


def _fn(name: str, restype, argtypes):
    f = getattr(_libc, name, None) if _libc is not None else None
    if f is not None:
        f.restype, f.argtypes = restype, argtypes
    return f


memcpy = _fn("memcpy", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])
memcmp = _fn("memcmp", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])
mmap = _fn("mmap", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_long])
munmap = _fn("munmap", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t])
mallopt = _fn("mallopt", ctypes.c_int, [ctypes.c_int, ctypes.c_int])  # glibc only
malloc = _fn("malloc", ctypes.c_void_p, [ctypes.c_size_t])
free = _fn("free", None, [ctypes.c_void_p])


def errno() -> int:
    return ctypes.get_errno()
