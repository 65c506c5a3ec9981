"""Hiding secrets in a config before it leaves the run (trackers, the HTML report).

A run config can hold a weight-sync token and a Redis URL with a password; a hosted wandb or
MLflow server, or a report page mailed around, is outside the run's trust.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# `headers`: an MCP server's HTTP headers (rollout.mcp_servers[].headers) carry credentials
# by design, under any name (Authorization, X-Api-Key, a tenant id), so all of them are hidden.
_SECRET_KEY = re.compile(r"token|password|secret|api_key|authorization|cookie|headers",
                         re.IGNORECASE)
_URL_CREDENTIALS = re.compile(r"(://)[^/@\s]*@")


def redact(config: Any) -> Any:
    """The config with secrets hidden: values of keys named like a token, password or HTTP
    headers, and the user:password part of URLs."""
    if isinstance(config, Mapping):
        return {k: ("***" if _SECRET_KEY.search(str(k)) and v is not None else redact(v))
                for k, v in config.items()}
    if isinstance(config, list):
        return [redact(v) for v in config]
    if isinstance(config, str):
        return _URL_CREDENTIALS.sub(r"\1***@", config)
    return config
