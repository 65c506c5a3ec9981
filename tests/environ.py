"""The process environment as a test found it, for in-process code that rewrites it.

vLLM's CPU platform configures its own process through `os.environ` when an engine starts
(`LOCAL_WORLD_SIZE` = the tensor-parallel size, `LD_PRELOAD`, `VLLM_WORKER_MULTIPROC_METHOD`,
thread settings): right in a rollout replica, which holds one engine for its life, but in a test
worker every later test and every process it starts inherits them. One did: with `LOCAL_WORLD_SIZE=2`
left by the tensor-parallel engine test and `LOCAL_RANK` left by an in-process trainer,
accelerate took the worker for a two-process CPU launch and TRL's config test failed
("Tried to launch on distributed with multinode").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environ_restored() -> Iterator[dict[str, str]]:
    """On exit, `os.environ` holds exactly what it held on entry: keys added inside are removed,
    changed or removed ones put back. Yields the entry snapshot."""
    before = dict(os.environ)
    try:
        yield before
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
