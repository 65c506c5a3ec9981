"""configs/bare_metal.yaml, the overlay of docs/quickstart-bare-metal.md: merged over the
Search-R1 recipe it leaves no container name or wildcard bind address, only loopback; it reads
and writes under ./data and ./runs; it sizes the run as the 1-GPU compose layout does (the one
`forage plan` checks); and `forage config show` / `forage plan` accept the combination."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services.cli import main
from services.common.config import load_config
from services.common.plan_layout import layout_files, read_layout

REPO = Path(__file__).resolve().parents[2]
FILES = [REPO / "configs" / "search_r1_nq_hotpotqa.yaml", REPO / "configs" / "bare_metal.yaml"]
LAYOUT = REPO / "deploy" / "compose" / "gpus-1.yml"


def leaves(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in leaves(value, (*path, key))]
    if isinstance(node, list):
        return [leaf for i, value in enumerate(node) for leaf in leaves(value, (*path, str(i)))]
    return [(".".join(path), node)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def merged() -> dict[str, Any]:
    return load_config(FILES, environ={}).model_dump(mode="json")


def test_every_address_is_loopback() -> None:
    cfg = merged()
    assert cfg["redis"]["url"] is None  # forage up: 127.0.0.1:6379, else an embedded server
    addresses = [(key, value) for key, value in leaves(cfg)
                 if key.rsplit(".", 1)[-1] in ("host", "url") or key.endswith(("_host",
                                                                               "_advertise"))]
    assert len(addresses) >= 8, addresses
    wrong = [(key, value) for key, value in addresses if value not in (None, "")
             and not is_loopback(urlparse(value).hostname if "://" in value else value)]
    assert not wrong, f"addresses that leave this machine or name a container: {wrong}"
    # "" relay host and advertise: the relay binds rollout.host and other replicas dial that
    assert cfg["rollout"]["weight_relay_host"] in ("", cfg["rollout"]["host"])
    assert cfg["rollout"]["weight_relay_advertise"] in ("", cfg["rollout"]["host"])


def test_paths_are_under_data_and_runs() -> None:
    cfg = merged()
    paths = [cfg["run_dir"], cfg["retriever"]["index_dir"], cfg["model"]["path"],
             *cfg["data"]["train_files"], *cfg["data"]["test_files"]]
    assert cfg["learner"]["checkpoint_dir"] is None  # RUN_DIR/checkpoints
    assert all(p.startswith(("data/", "runs/")) for p in paths), paths


def test_sized_as_the_one_gpu_layout() -> None:
    """The overlay holds the --set overrides deploy/compose/gpus-1.yml gives each service, so the
    plan of that layout is the plan of this run (everything on GPU 0, the retriever on CPU)."""
    cfg = merged()
    sets = [o for p in read_layout(*layout_files(LAYOUT)) for o in p.overrides]
    assert sets, "gpus-1.yml sets no overrides any more: update this test"
    for override in sets:
        key, _, value = override.partition("=")
        section, name = key.split(".")
        assert cfg[section][name] == yaml.safe_load(value), override


def test_config_show_and_plan_accept_it(capsys: pytest.CaptureFixture) -> None:
    files = [a for f in FILES for a in ("--config", str(f))]
    assert main(["config", "show", *files]) == 0
    assert "weight_sync_host: 127.0.0.1" in capsys.readouterr().out
    assert main(["plan", *files, "--layout", str(LAYOUT)]) == 0  # 0: it fits
    assert "fits" in capsys.readouterr().out
