"""A fetch's checksum gives the same digest on the receiving thread and on a helper thread."""

from __future__ import annotations

import hashlib
import os
import zlib

import pytest
import xxhash

from services.common.weight_sync import checksum, wire


@pytest.mark.parametrize("algo", wire.CHECKSUMS)
def test_inline_and_threaded_digests_match_the_reference(algo):
    chunks = [os.urandom(n) for n in (1, 4096, 70_000, 0, 3 << 20, 17)]
    if algo == "crc32":
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        reference = f"{crc:08x}"
    elif algo == "xxh3_64":
        reference = xxhash.xxh3_64(b"".join(chunks)).hexdigest()
    else:
        reference = hashlib.new(algo, b"".join(chunks)).hexdigest()
    for threaded in (False, True):
        digest = checksum.chunk_checksum(algo, threaded)
        for c in chunks:
            digest.update(memoryview(c))
        assert digest.hexdigest() == reference, (algo, threaded)
        digest.close()  # idempotent after hexdigest


def test_helper_thread_is_chosen_by_usable_cores():
    auto = checksum.chunk_checksum("crc32")
    try:
        wanted = checksum.usable_cpus() >= checksum.HELPER_THREAD_MIN_CPUS
        assert isinstance(auto, checksum.ThreadedChecksum) is wanted
    finally:
        auto.close()


def test_unknown_algorithm_is_a_manifest_error():
    with pytest.raises(wire.WeightSyncError) as err:
        checksum.chunk_checksum("md5", threaded=True)
    assert err.value.reason == "manifest"
