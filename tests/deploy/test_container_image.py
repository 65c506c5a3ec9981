"""Forage's CPU image, built and run in real containers on this machine.

A private Docker engine (tests/deploy/dockerd.py: its own data root, socket and networks;
nothing can be pulled), local stand-ins for the base images under the names the Dockerfile and
compose file use (deploy/local-base-images.sh), and deploy/build-offline.sh: a host-side
wheelhouse and `docker build --network=none` of deploy/Dockerfile's cpu target, unchanged but
for its documented offline mode. Then the image runs: `forage` as user 1000 with a writable
/data, a reward scored by `forage score`, Redis reached by its service name on a
user-defined network, as the compose file wires them, and `forage doctor` finding vLLM's CPU
build (the compose layout's rollout engine) importable beside the image's torch.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
REDIS_IMAGE = "redis:7.2.5-alpine"
NETWORK = "forage-test"


def test_cpu_image_builds_offline_and_runs_with_redis_by_name(forage_cpu_image):
    engine = forage_cpu_image
    engine.docker("network", "create", NETWORK)
    try:
        engine.docker("run", "-d", "--name", "redis", "--network", NETWORK, REDIS_IMAGE,
                      "redis-server", "--save", "", "--appendonly", "yes")
        script = (
            "set -e; forage --version; id -u; touch /data/written && echo data-writable; "
            "forage score --data-source nq --solution '<answer> Paris </answer>' "
            "--ground-truth '{\"target\": [\"paris\"]}'; "
            "python -c \"import redis; print('redis-by-name', redis.Redis(host='redis', "
            "socket_timeout=10).ping())\"; "
            "python -c \"from services.learner.op_build_watch import own_extensions_dir as o;"
            " print('op-folder', o())\"; "
            "forage doctor --json >/tmp/doctor.json || true; "
            "echo doctor-begin; cat /tmp/doctor.json; echo; echo doctor-end"
        )
        out = engine.docker("run", "--rm", "--network", NETWORK, "--entrypoint", "sh",
                            "forage:cpu", "-c", script)
        text = out.stdout
        lines = text.splitlines()
        assert lines[0].startswith("forage "), text
        assert "1000" in lines and "data-writable" in lines, text
        assert any(line.startswith('{"score": 1.0') for line in lines), text
        assert "redis-by-name True" in lines, text
        # DeepSpeed's CPU op was built in the image, where a learner run as this user loads it
        # (the image build ran `forage learner build-ops` as user 1000)
        folder = next(line.split(" ", 1)[1] for line in lines if line.startswith("op-folder "))
        built = engine.docker("run", "--rm", "--entrypoint", "sh", "forage:cpu", "-c",
                              f"ls {folder}/deepspeed_shm_comm/deepspeed_shm_comm.so")
        assert built.stdout.strip().endswith("deepspeed_shm_comm.so"), built.stdout
        doctor = json.loads(text.split("doctor-begin", 1)[1].split("doctor-end", 1)[0])
        assert doctor["ok"] and doctor["errors"] == 0, doctor["findings"]
        assert doctor["versions"]["vllm"] == "0.32.0", doctor["versions"]
        user = engine.docker("image", "inspect", "--format", "{{.Config.User}}", "forage:cpu")
        assert user.stdout.strip() == "1000:1000"
    finally:  # the engine is shared with the compose test
        engine.docker("rm", "-f", "redis", check=False)
        engine.docker("network", "rm", NETWORK, check=False)
