"""Structured logs: every line names the service, the run and the current policy version.

One JSON object per line when FORAGE_LOG_FORMAT=json (for log shippers), a readable single
line otherwise; in either, a URL's password (and a secret query parameter) shows as `***`
(services/common/redact.py). The policy version is process state that the service updates
when it loads or publishes weights, so every later line carries it without threading it
through calls.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from services.common.redact import redact_text

_context: dict[str, object] = {"service": "forage", "run_id": "-", "policy_version": 0}


def set_log_context(**values: object) -> None:
    """Update the fields stamped on every log line (service, run_id, policy_version, ...)."""
    _context.update(values)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.items():
            setattr(record, key, value)
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact_text(record.getMessage()),
        }
        body.update({key: getattr(record, key, None) for key in _context})
        if record.exc_info:
            body["exc"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(body, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


_TEXT_FORMAT = (
    "%(asctime)s %(levelname)s [%(service)s run=%(run_id)s v=%(policy_version)s] "
    "%(name)s: %(message)s"
)


def setup_logging(service: str, run_id: str = "-", level: str | int = "INFO") -> logging.Logger:
    """Configure the root logger once per process; returns the service's logger."""
    set_log_context(service=service, run_id=run_id)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_forage", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._forage = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    if os.environ.get("FORAGE_LOG_FORMAT", "text") == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        formatter = _TextFormatter(_TEXT_FORMAT, "%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    return logging.getLogger(f"forage.{service}")
