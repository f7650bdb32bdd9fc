"""Host-memory policy for training on the CPU.

A training step allocates and frees the same large tensors every step (logits, attention and Muon
buffers, tens of MB each). glibc serves blocks above its mmap threshold (128 KB, adapting up to 32 MB)
with fresh mmap()ed pages and unmaps them on free, so every step pays a page fault per 4 KB touched, an
order of magnitude slower than writing reused memory (docs/training.md has the measurement). Keeping
freed memory in the heap for reuse removes that; the cost is a resident set that stays at the run's
peak, which a training process reaches anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse (no mmap per allocation, no trimming) for the rest
    of the process. Returns whether the policy is in effect (False where the C library is not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # blocks up to 1 GB come from the heap
    ok &= mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)  # never give the heap's top back
    ok &= mallopt(_M_TOP_PAD, 64 << 20)  # grow the heap in 64 MB steps
    return bool(ok)
