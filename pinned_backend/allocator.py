"""The C allocator kept from handing a CPU step's memory back to the kernel between layers.

glibc's malloc maps a request of 128 KiB or more straight from the kernel and unmaps it when freed (its threshold
rises as such blocks are freed), and hands free memory at the heap's top back to the kernel past a trim threshold
that follows it. A CPU step allocates and frees tensors of megabytes at every layer (the attention's keys and values
gathered from the paged cache, its scores), so its memory went back to the kernel and came again, and every page
faults on first touch: at a few hundred tokens of context that cost more than the attention's arithmetic.
Raising the mapping threshold and the trim threshold keeps freed blocks in the heap for the next layer to reuse,
as the allocators that CPU inference servers preload (tcmalloc, jemalloc) do. One arena serves every thread: a
thread started afterwards (the engine's) would otherwise get an arena of its own, made of heaps of at most 64 MiB,
from which a larger tensor is still mapped and unmapped at every step. Hence the tuning runs before the engine's
thread starts. The process then keeps the peak of a step's transient memory; what a step computes is unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_MAP_FROM = 1 << 30  # a request this large (a model's weights, the KV cache) is still mapped on its own
_KEEP_FREE = 1 << 30  # free memory at the heap's top kept rather than returned
_GROW_BY = 64 << 20  # extra room taken whenever the heap grows, so that it grows rarely


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above, once per process; False where the C library is not glibc (nothing changes) or
    refused a setting (the others still apply)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_THRESHOLD, _MAP_FROM),
        (_M_TRIM_THRESHOLD, _KEEP_FREE),
        (_M_TOP_PAD, _GROW_BY),
    )
    # Each is tried: a glibc that caps one (older ones cap the mapping threshold at 32 MiB) still takes the others.
    applied = [mallopt(param, value) == 1 for param, value in settings]
    return all(applied)
