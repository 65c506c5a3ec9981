"""The client's glibc malloc tuning: freed receive-sized buffers are reused, not faulted again.

Each case runs in a fresh interpreter, since the setting is process-wide and this test process
may already have made a client (which applies it).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.weight_sync import malloc_tuning

ROOT = Path(__file__).resolve().parents[2]
BUFFER = 6 << 20  # the size class of a received 4 MiB chunk and gRPC's buffers for it
PAGES = 3 * BUFFER // 4096

# What a fetch does to the allocator, reduced: a few multi-MiB buffers live at once, freed, then
# allocated again for the next message. Counts the page faults of the later rounds.
PROBE = f"""
import json, resource, sys
sys.path.insert(0, {str(ROOT)!r})
applied = None
if sys.argv[1] == "tune":
    from services.common.weight_sync import malloc_tuning
    applied = malloc_tuning.keep_receive_buffers()
    again = malloc_tuning.keep_receive_buffers()
    assert again is applied
def round_():
    a = b"a" * {BUFFER}; b = b"b" * {BUFFER}; c = b"c" * {BUFFER}
    del a, b, c
for _ in range(3):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
print(json.dumps({{"applied": applied, "faults": faults}}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")
def test_tuned_process_reuses_freed_buffers_instead_of_faulting_new_pages():
    untuned = _probe("none")
    tuned = _probe("tune")
    assert tuned["applied"] is True
    # glibc's defaults give every round fresh pages (mmap/munmap or a trimmed arena top) ...
    assert untuned["faults"] > PAGES / 2, untuned
    # ... the pinned thresholds keep them mapped, so a round touches no new page
    assert tuned["faults"] < PAGES / 50, tuned


def test_keep_receive_buffers_is_idempotent_and_reports_what_it_did():
    first = malloc_tuning.keep_receive_buffers()
    assert malloc_tuning.keep_receive_buffers() is first
    assert first is (platform.libc_ver()[0] == "glibc")
