"""services/common/redact.py: which keys and URL parts are secrets, and a redacted config's
way back (forage up's children restore the real values; anyone else is told to pass them)."""

from __future__ import annotations

import json

import pytest

from services.common.config import ConfigError, RunConfig, load_config
from services.common.redact import (
    dotted,
    is_secret_key,
    placeholders,
    redact,
    redact_text,
    redact_url,
    restore,
    scrub,
    secret_leaves,
)


@pytest.mark.parametrize("url,shown", [
    ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
    ("rediss://default:p%40ss@host/1", "rediss://default:***@host/1"),
    ("redis://u:p@ss@host:6379/0", "redis://u:***@host:6379/0"),  # unescaped '@', as redis-py
    ("https://ghp_token@github.com/x.git", "https://***@github.com/x.git"),
    ("http://kb:8000/mcp?api_key=abc&top=3", "http://kb:8000/mcp?api_key=***&top=3"),
    ("http://host/search?q=a@b", "http://host/search?q=a@b"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("not a url", "not a url"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert redact_url(None) is None


def test_redact_text_hides_every_url_in_a_message():
    text = "no Redis answers at redis://u:hunter2@h:6379/0 (named by redis.url); bob@x.org"
    assert redact_text(text) == ("no Redis answers at redis://u:***@h:6379/0 (named by "
                                 "redis.url); bob@x.org")


def test_secret_keys_are_whole_words():
    for name in ("weight_sync_token", "GITHUB_TOKEN", "hf_token", "password", "X-Api-Key",
                 "apiKey", "Authorization", "client_secret", "AWS_SECRET_ACCESS_KEY", "Cookie"):
        assert is_secret_key(name), name
    for name in ("tokenizer_path", "max_tokens_per_turn", "micro_batch_tokens", "url",
                 "headers", "env", "keyword", "monkey"):
        assert not is_secret_key(name), name


def test_redact_a_run_config():
    raw = RunConfig.model_validate({
        "redis": {"url": "redis://default:pw@10.0.0.5:6379/0"},
        "model": {"tokenizer_path": "/models/tok"},
        "learner": {"weight_sync_token": "s3cret-token"},
        "rollout": {"mcp_servers": [
            {"name": "kb", "url": "http://kb:8000/mcp",
             "headers": {"Authorization": "Bearer literal-secret", "X-Tenant": "acme",
                         "X-Key": "Bearer ${KB_TOKEN}"}},
            {"name": "gh", "command": "gh-mcp", "args": ["--db", "postgres://u:dbpw@db/x"],
             "env": {"GITHUB_TOKEN": "ghp_x", "LOG_LEVEL": "debug"}}]},
    }).model_dump(mode="json")
    shown = redact(raw)
    assert shown["redis"]["url"] == "redis://default:***@10.0.0.5:6379/0"
    assert shown["learner"]["weight_sync_token"] == "***"
    assert shown["model"]["tokenizer_path"] == "/models/tok"
    assert shown["rollout"]["max_tokens_per_turn"] == raw["rollout"]["max_tokens_per_turn"]
    kb, gh = shown["rollout"]["mcp_servers"]
    # header names stay; a value naming an environment variable is not a secret
    assert kb["headers"] == {"Authorization": "***", "X-Tenant": "***",
                             "X-Key": "Bearer ${KB_TOKEN}"}
    assert gh["args"] == ["--db", "postgres://u:***@db/x"]
    assert gh["env"] == {"GITHUB_TOKEN": "***", "LOG_LEVEL": "debug"}
    assert redact({"weight_sync_token": None}) == {"weight_sync_token": None}
    text = json.dumps(shown)
    for secret in ("pw@", "s3cret-token", "literal-secret", "acme", "dbpw", "ghp_x"):
        assert secret not in text
    assert raw["learner"]["weight_sync_token"] == "s3cret-token"  # a copy: the input stays

    # The way back: the placeholders are found, and the hidden leaves fill them in again.
    leaves = secret_leaves(raw)
    assert {dotted(p) for p, _ in leaves} == {
        "redis.url", "learner.weight_sync_token",
        "rollout.mcp_servers[0].headers.Authorization", "rollout.mcp_servers[0].headers.X-Tenant",
        "rollout.mcp_servers[1].args[1]", "rollout.mcp_servers[1].env.GITHUB_TOKEN"}
    assert sorted(placeholders(shown)) == sorted(p for p, _ in leaves)
    assert placeholders(raw) == []
    assert sorted(restore(shown, leaves)) == sorted(p for p, _ in leaves)
    assert shown == raw
    # a value set since (not the placeholder any more) is never replaced
    other = redact(raw)
    other["learner"]["weight_sync_token"] = "new-token"
    restore(other, leaves)
    assert other["learner"]["weight_sync_token"] == "new-token"


def test_scrub_hides_a_configs_secrets_in_any_text():
    config = {"learner": {"weight_sync_token": "s3cret-token"},
              "redis": {"url": "redis://u:pw-long@h/0"}}
    text = "learner: bad; on the command line: learner.weight_sync_token=s3cret-token"
    assert scrub(text, config) == ("learner: bad; on the command line: "
                                   "learner.weight_sync_token=***")


def test_a_saved_config_needs_its_secrets_again(tmp_path):
    raw = RunConfig.model_validate({
        "redis": {"url": "redis://default:pw-1234@10.0.0.5:6379/0"},
        "learner": {"weight_sync_token": "s3cret-token"},
        "rollout": {"mcp_servers": [{"name": "kb", "url": "http://kb:8000/mcp",
                                     "headers": {"Authorization": "Bearer literal-secret"}}]},
    }).model_dump(mode="json")
    saved = tmp_path / "config.yaml"
    import yaml

    saved.write_text(yaml.safe_dump(redact(raw)))
    with pytest.raises(ConfigError) as info:
        load_config(saved, environ={})
    message = str(info.value)
    assert "3 problems" in message
    assert "redis.url: holds ***" in message and "REDIS_URL" in message
    assert "learner.weight_sync_token: holds ***" in message
    assert "FORAGE_WEIGHT_SYNC_TOKEN" in message
    assert "rollout.mcp_servers[0].headers.Authorization" in message
    assert str(saved) in message
    # What forage up hands its children: every hidden value, restored where it was hidden.
    secrets = json.dumps([[list(p), v] for p, v in secret_leaves(raw)])
    cfg = load_config(saved, environ={"FORAGE_CONFIG_SECRETS": secrets})
    assert cfg.model_dump(mode="json") == raw
    with pytest.raises(ConfigError, match="FORAGE_CONFIG_SECRETS"):
        load_config(saved, environ={"FORAGE_CONFIG_SECRETS": "{not json"})


def test_config_errors_never_quote_a_secret():
    # an override that does not parse is quoted, its secret value not
    with pytest.raises(ConfigError) as info:
        load_config(None, ["learner.weight_sync_token=tok-abc9: ["], environ={})
    assert "tok-abc9" not in str(info.value) and "weight_sync_token=***" in str(info.value)
    # a value of the wrong type is quoted, a URL's password not
    with pytest.raises(ConfigError) as info:
        load_config(None, ["redis.url=[redis://u:pw-9zz@h/0]"], environ={})
    assert "pw-9zz" not in str(info.value) and "redis://u:***@h/0" in str(info.value)
    # an error about a whole section quotes the section, secrets hidden
    with pytest.raises(ConfigError) as info:
        load_config(None, ["learner.weight_sync_token=tok-abc9", "learner.warmup_ratio=0.1",
                           "learner.warmup_steps=5"], environ={})
    assert "tok-abc9" not in str(info.value) and "'weight_sync_token': '***'" in str(info.value)
