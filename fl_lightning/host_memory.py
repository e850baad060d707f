"""A rank's host heap between rounds: its free pages given back to the system.

glibc's malloc keeps memory a process frees for its next allocations. It returns free memory at the
heap's top only past a threshold that it raises to twice the largest mapped block freed so far (up to 64
MiB), and free pages amid the heap only when asked. A round of a large federation allocates and frees
blocks of megabytes (the draw of a million clients, the bookkeeping of a round of tens of thousands)
among small blocks that live on (the client states in memory), so round after round a rank's heap
holds tens of MiB of free pages: its resident memory grows with the clients of a round, not with what
it keeps. `release_free_heap` asks for them once a round (glibc's `malloc_trim`: a fraction of a
millisecond, tens of milliseconds for a heap of hundreds of MiB in small blocks); with another C
library it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable, Optional


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl's C library has none
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; whether this C library can."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
