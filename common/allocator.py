"""glibc's malloc kept from handing freed memory back to the kernel, for processes that allocate
and free multi-MB buffers on every request (decoded pages, token sequences, their host copies).

By default glibc serves large allocations with fresh mmaps and trims what is freed at the top
of the heap, so every 2 MB page buffer is new memory whose ~512 pages fault in when first
written. On this project's VMs that made copying a decoded page into a numpy array 3.0 ms
instead of 0.17 ms, and a PNG page's decode 7.9 ms instead of 5.9 (2-core dev VM). With both
thresholds raised (`mallopt`), such buffers come from, and go back to, memory the process
already has; the price is up to `trim_mb` of freed memory kept mapped per process.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_freed_memory(mmap_mb: int = 64, trim_mb: int = 256) -> bool:
    """Allocations under `mmap_mb` MB from the heap, and up to `trim_mb` MB of freed memory kept
    for the next ones. True where it took (glibc); False elsewhere (macOS, musl), a no-op."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library this process runs on
    if mallopt is None:
        return False
    return mallopt(M_MMAP_THRESHOLD, mmap_mb << 20) == 1 and mallopt(M_TRIM_THRESHOLD, trim_mb << 20) == 1
