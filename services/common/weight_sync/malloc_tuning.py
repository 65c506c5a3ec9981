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
process-wide and set once; it does nothing where the C library is not glibc. The mechanism
lives in services/common/malloc_tuning.py (the retriever's encoder uses it too).
"""

from __future__ import annotations

from services.common.malloc_tuning import (  # noqa: F401 (this module's public names)
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
)
from services.common.malloc_tuning import keep_freed_memory as keep_receive_buffers

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_receive_buffers"]
