"""Keep glibc from handing freed multi-MiB buffers back to the kernel, so the next allocation of
the same size reuses mapped pages instead of faulting in and zeroing new ones.

With glibc's default heuristics a buffer of a few MiB is either `mmap`ed and unmapped again on
free, or carved from an arena whose top is trimmed as soon as more than twice the last freed
mmap size lies free. A process that allocates and frees such buffers in a loop then pays a page
fault per 4 KiB page each time (on the VMs measured first-touch faults ran at ~1 GB/s). Two
users: the weight-sync client's gRPC receive buffers (services/common/weight_sync) and the
retriever's encoder activations (a 64-query MiniLM forward allocates 6 MiB outputs per layer:
211k page faults and 10% of the forward's time over 25 batches, 2k with the thresholds pinned;
bench/README.md).

`keep_freed_memory()` pins the two thresholds at the ceiling glibc's own dynamic rule reaches in
any process that has freed a buffer of 32 MiB (mmap threshold 32 MiB, trim threshold twice
that). Allocations below 32 MiB then reuse arena memory, and up to 64 MiB of free memory stays
mapped per arena. Larger allocations are still `mmap`ed and returned on free. It is process-wide
and set once; it does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading

log = logging.getLogger("forage.malloc")

# mallopt(3) parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the most mallopt accepts and the ceiling of the
# dynamic threshold; its dynamic rule sets the trim threshold to twice the mmap threshold.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Pin glibc's mmap and trim thresholds (see the module docstring) once per process.

    Returns True when they are set (now or by an earlier call), False on a C library other
    than glibc or when mallopt refused.
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("glibc malloc thresholds %s: mmap %d, trim %d",
              "pinned" if ok else "refused", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return ok
