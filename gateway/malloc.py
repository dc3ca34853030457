"""Large allocations go back to the system when they are freed (glibc).

glibc serves an allocation above its mmap threshold with a mapping of its own, unmapped on
free. But each such free raises the threshold to the size freed (up to 32 MiB), and from then
on blocks of that size come from the heap or from a thread's arena, where a freed block stays
in the process unless it happens to lie at the top of the main heap. A gateway parses bodies
of up to `max_body_bytes` in several threads, one after another: with the threshold moving,
the memory of bodies long answered stays resident and adds up across arenas. Fixed, every
large block is a mapping of its own again and leaves with its body.
"""

from __future__ import annotations

import ctypes

# mallopt's parameter number for the threshold (malloc.h); setting it also turns off glibc's
# moving of it.
M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks_to_the_system(threshold_bytes: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix the C library's mmap threshold at `threshold_bytes` for this process. False where
    that cannot be done (a C library without mallopt, or one that refuses the value)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
