"""Forage's CPU image, built and run in real containers on this machine.

A private Docker engine (tests/deploy/dockerd.py: its own data root, socket and networks;
nothing can be pulled), local stand-ins for the base images under the names the Dockerfile and
compose file use (deploy/local-base-images.sh), and deploy/build-offline.sh: a host-side
wheelhouse and `docker build --network=none` of deploy/Dockerfile's cpu target, unchanged but
for its documented offline mode. Then the image runs: `forage` as user 1000 with a writable
/data, a reward scored by `forage score`, and Redis reached by its service name on a
user-defined network, as the compose file wires them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dockerd import Dockerd, DockerdError  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
REDIS_IMAGE = "redis:7.2.5-alpine"
NETWORK = "forage-test"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "the private Docker engine needs root"
    for tool in ("dockerd", "debootstrap"):
        if shutil.which(tool) is None:
            return f"no {tool} (make test installs Debian's docker.io and debootstrap as root)"
    return None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("dockerd")
    try:  # overlay2 where the kernel and filesystem allow it: ~3x faster than vfs here
        started = Dockerd(root / "overlay", storage_driver="overlay2").start()
    except DockerdError:
        started = Dockerd(root / "vfs", storage_driver="vfs").start()
    try:
        yield started
    finally:
        started.stop()


def test_cpu_image_builds_offline_and_runs_with_redis_by_name(engine):
    env = dict(os.environ, **engine.env)
    bases = subprocess.run(["bash", str(REPO / "deploy" / "local-base-images.sh")], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=1800)
    assert bases.returncode == 0, bases.stdout[-3000:] + bases.stderr[-5000:]
    build = subprocess.run(["bash", str(REPO / "deploy" / "build-offline.sh"), "forage:cpu"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]

    engine.docker("network", "create", NETWORK)
    engine.docker("run", "-d", "--name", "redis", "--network", NETWORK, REDIS_IMAGE,
                  "redis-server", "--save", "", "--appendonly", "yes")
    script = (
        "set -e; forage --version; id -u; touch /data/written && echo data-writable; "
        "forage score --data-source nq --solution '<answer> Paris </answer>' "
        "--ground-truth '{\"target\": [\"paris\"]}'; "
        "python -c \"import redis; print('redis-by-name', redis.Redis(host='redis', "
        "socket_timeout=10).ping())\""
    )
    out = engine.docker("run", "--rm", "--network", NETWORK, "--entrypoint", "sh",
                        "forage:cpu", "-c", script)
    text = out.stdout
    lines = text.splitlines()
    assert lines[0].startswith("forage "), text
    assert "1000" in lines and "data-writable" in lines, text
    assert any(line.startswith('{"score": 1.0') for line in lines), text
    assert "redis-by-name True" in lines, text
    user = engine.docker("image", "inspect", "--format", "{{.Config.User}}", "forage:cpu")
    assert user.stdout.strip() == "1000:1000"
