"""glibc malloc settings for a rank: keep message-sized buffers in the heap instead of fresh mmaps.

Every gRPC answer is a new `bytes` of up to a few MiB (1 MiB fetch chunks, lookup
replies). glibc serves allocations above its mmap threshold (128 KiB, raised
only as large blocks are freed) with a new mapping, so each one page-faults all
its pages in, and giving them back trims the heap again: on this 2-core host a
64 MiB gRPC fetch took 65-77 ms that way and 51-55 ms with buffers reused from
the heap. A rank therefore sets, once at start (`mallopt`):

- M_MMAP_THRESHOLD = 32 MiB: buffers below it come from the heap (shards are
  shared memory or torch tensors of their own and are not affected by this);
- M_TRIM_THRESHOLD = 256 MiB and M_TOP_PAD = 16 MiB: freed heap memory up to
  that much is kept for the next message instead of returned at once.

The cost is up to ~256 MiB of freed heap a rank may keep. SHARDSERVE_MALLOC_TUNING=0
leaves glibc's defaults; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
SETTINGS = {
    "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 32 << 20),
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, 256 << 20),
    "M_TOP_PAD": (_M_TOP_PAD, 16 << 20),
}


def tune_malloc(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, int]:
    """Apply SETTINGS with glibc's mallopt; return what was set ({} when off, or not glibc)."""
    if environ.get("SHARDSERVE_MALLOC_TUNING", "1") == "0":
        return {}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    applied = {}
    for name, (option, value) in SETTINGS.items():
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) == 1:
            applied[name] = value
        else:
            log.warning("mallopt(%s, %d) failed; glibc's default stays", name, value)
    return applied
