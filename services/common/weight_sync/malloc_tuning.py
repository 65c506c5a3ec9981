"""Keep glibc from returning gRPC's receive buffers to the kernel between two messages.

grpcio reads the stream into buffers its event-engine threads allocate, and hands every
message to Python as a fresh `bytes` object. With glibc's default heuristics such multi-MiB
buffers are either `mmap`ed and unmapped again, or carved from an arena whose top is trimmed
as soon as more than twice the last freed mmap size lies free. Either way the next message
lands on pages the kernel must fault in and zero again: a 512 MiB fetch paid 24k-125k
page faults (it spans 131k pages; counted with getrusage, traced with perf to the
event-engine threads' recvmsg and the copy into `bytes`), and on the VMs measured first-touch
faults of 4 KiB pages ran at ~1 GB/s, slower than the socket.

`keep_receive_buffers()` pins the two thresholds at the ceiling glibc's own dynamic rule
reaches in any process that has freed a buffer of 32 MiB (mmap threshold 32 MiB, trim
threshold twice that). Allocations below 32 MiB then reuse arena memory, and up to 64 MiB of
free memory stays mapped per arena instead of being handed back after every message. Larger
allocations (the staging buffer, tensors) are still `mmap`ed and returned on free. It is
process-wide and set once; it does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading

log = logging.getLogger("forage.weight_sync")

# mallopt(3) parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the most mallopt accepts and the ceiling of the
# dynamic threshold; its dynamic rule sets the trim threshold to twice the mmap threshold.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_lock = threading.Lock()
_applied: bool | None = None


def keep_receive_buffers() -> bool:
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
