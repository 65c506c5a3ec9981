"""Nothing secret on disk or in logs: a Redis password and a weight-sync token, planted in a
run's config, appear nowhere in what `forage config show` prints, in the run directory that
`forage up` writes (config.yaml, services.json, every service's log), in the trackers' files,
or in error messages and log lines. The Redis is a real one that requires the password, and
the services still reach it: they get the secrets from `forage up`'s environment, and a
resume by hand is told to pass them again."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Zq7rX9-planted"
TOKEN = "tok-Kf3mW8-planted"
PLANTED = (PASSWORD, TOKEN)


@pytest.fixture(scope="module")
def password_redis():
    """A real redis-server that refuses clients without PASSWORD (user `default`)."""
    from services.common.redis_server import start_embedded_redis

    server = start_embedded_redis(password=PASSWORD)
    yield server
    server.stop()


def leaks(root: Path) -> list[str]:
    """Every file under `root` (recursively) holding a planted secret."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(root)}: {s}" for s in PLANTED if s.encode() in data]
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no REDIS_URL or token (the session's Redis fixture
    sets REDIS_URL, which would replace the config's redis.url)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "FORAGE_WEIGHT_SYNC_TOKEN", "FORAGE_CONFIG_SECRETS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def forage(*args: str, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                          env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_config_show_prints_no_secret(password_redis):
    url = password_redis.url
    assert PASSWORD in url
    out = forage("config", "show", "--set", f"redis.url={url}",
                 "--set", f"learner.weight_sync_token={TOKEN}", "--sources")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert not [s for s in PLANTED if s in text], text
    shown = yaml.safe_load(out.stdout)
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert shown["redis"]["url"] == f"redis://default:***@127.0.0.1:{port}/0"
    assert shown["learner"]["weight_sync_token"] == "***"
    assert "learner.weight_sync_token: the command line" in out.stdout  # --sources: no value

    # An error about the learner section names every override that set a learner key: the
    # token's is among them, its value hidden.
    out = forage("config", "show", "--set", f"learner.weight_sync_token={TOKEN}",
                 "--set", "learner.warmup_ratio=0.1", "--set", "learner.warmup_steps=5",
                 "--set", f"redis.url={url}")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "warmup_steps or learner.warmup_ratio" in text
    assert not [s for s in PLANTED if s in text], text


def test_up_writes_no_secret_and_services_still_get_them(tmp_path, password_redis):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    # No model.path: the learner stops at start-up (exit 2) after reading the run's config,
    # the cheapest `forage up` that writes a run directory and starts a service.
    config.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "redis": {"url": password_redis.url, "namespace": f"secrets-{uuid.uuid4().hex[:8]}",
                  "embedded": False},
        "learner": {"weight_sync_token": TOKEN, "logger": ["console", "jsonl"]},
    }))
    out = forage("up", "--config", str(config))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    # The learner read the redacted config.yaml and got the real secrets from forage up's
    # environment: it went on to its own check instead of refusing the `***`.
    assert "model.path is not set" in text, text
    assert not [s for s in PLANTED if s in text], text
    assert leaks(run_dir) == []
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    port = password_redis.url.rsplit(":", 1)[1].split("/")[0]
    assert saved["redis"]["url"] == f"redis://default:***@127.0.0.1:{port}/0"
    assert saved["learner"]["weight_sync_token"] == "***"

    # Resume by hand from the saved config: without the secrets it is refused, naming them
    # and where to pass them; with them in the environment it loads the real values and
    # reaches the password-protected Redis.
    from services.common.config import ConfigError, load_config
    from services.common.streams import RedisStreams

    with pytest.raises(ConfigError) as info:
        load_config(run_dir / "config.yaml", environ={})
    message = str(info.value)
    assert "redis.url" in message and "REDIS_URL" in message
    assert "learner.weight_sync_token" in message and "FORAGE_WEIGHT_SYNC_TOKEN" in message
    assert not [s for s in PLANTED if s in message]
    cfg = load_config(run_dir / "config.yaml", environ={
        "REDIS_URL": password_redis.url, "FORAGE_WEIGHT_SYNC_TOKEN": TOKEN})
    assert cfg.redis.url == password_redis.url and cfg.learner.weight_sync_token == TOKEN
    streams = RedisStreams.from_config(cfg.redis)
    assert streams.client.ping()
    # ... and on the command line, as any key.
    cfg = load_config(run_dir / "config.yaml", [f"redis.url={password_redis.url}",
                                                f"learner.weight_sync_token={TOKEN}"],
                      environ={})
    assert cfg.learner.weight_sync_token == TOKEN


def test_trackers_files_hold_no_secret(tmp_path):
    from services.learner.trackers import open_trackers

    names = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]
    names = [n for n in names if n in ("console", "jsonl") or _importable(n)]
    config = {"run_id": "secret-run",
              "redis": {"url": f"redis://default:{PASSWORD}@10.0.0.5:6379/0"},
              "learner": {"weight_sync_token": TOKEN, "logger": names}}
    run_dir = tmp_path / "run"
    trackers = open_trackers(names, run_dir, "secret-run", config)
    trackers.log_metrics({"kind": "train", "step": 1, "time": 1.7e9, "reward/mean": 0.5})
    trackers.close()
    assert leaks(run_dir) == []


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_error_messages_and_log_lines_hide_url_passwords(password_redis):
    from services.common.logs import setup_logging
    from services.common.redis_server import RedisUnavailable, ensure_redis

    dead = f"redis://default:{PASSWORD}@127.0.0.1:1/0"
    with pytest.raises(RedisUnavailable) as info:
        ensure_redis(dead, allow_embedded=False)
    assert PASSWORD not in str(info.value)
    assert "redis://default:***@127.0.0.1:1/0" in str(info.value)

    stream = io.StringIO()
    setup_logging("secrets-test")
    root = logging.getLogger()
    [handler] = [h for h in root.handlers if getattr(h, "_forage", False)]
    handler.setStream(stream)
    try:
        logging.getLogger("forage.test").warning("cannot reach Redis at %s", dead)
        try:
            raise ConnectionError(f"lost {password_redis.url}")
        except ConnectionError:
            logging.getLogger("forage.test").exception("redis failed")
    finally:
        root.removeHandler(handler)
    text = stream.getvalue()
    assert "cannot reach Redis at redis://default:***@127.0.0.1:1/0" in text
    assert "lost redis://default:***@127.0.0.1:" in text
    assert PASSWORD not in text
