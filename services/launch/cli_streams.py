"""`forage streams dead [--config FILE] [--stream KIND] [--limit N] [--json]`.

Shows what the services dead-lettered (`{namespace}:dead`, docs/architecture.md): when, from which
stream and consumer group, after how many deliveries, why, and what the message was, decoded
with the same codec the services use (never unpickled: the payload is msgpack or it is shown as
bytes). Newest first. It reads only: nothing is acked, deleted or re-published.

It never starts an embedded Redis (an empty one has nothing to show): the server is the config's
`redis.url`, else REDIS_URL, else 127.0.0.1:6379, and none answering is a one-line error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from services.common.cli_args import add_config_args

STREAM_KINDS = ("prompts", "rollouts", "scored")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")
    dead = sub.add_parser("dead", help="decode and show dead-lettered messages with reasons")
    add_config_args(dead, required=False)
    dead.add_argument("--stream", choices=STREAM_KINDS, default=None,
                      help="only messages dead-lettered from this stream")
    dead.add_argument("--limit", type=int, default=20,
                      help="show at most this many, newest first (default 20)")
    dead.add_argument("--json", action="store_true",
                      help="one JSON object per line instead of text")
    dead.set_defaults(handler=_dead)


def describe_payload(payload: bytes) -> dict[str, Any]:
    """What a dead-lettered payload was: the decoded record's identifying fields, or why it
    does not decode and its first bytes."""
    from services.common.codec import CodecError, decode
    from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory

    try:
        record = decode(payload)
    except CodecError as exc:
        return {"record": None, "decode_error": str(exc), "bytes": len(payload or b""),
                "head": (payload or b"")[:32].hex()}
    if isinstance(record, PromptGroup):
        prompt = record.prompt if isinstance(record.prompt, str) else " ".join(
            m["content"] for m in record.prompt)
        return {"record": "prompt_group", "uid": record.uid, "data_source": record.data_source,
                "kind": record.kind, "n": record.n, "attempt": record.attempt,
                "prompt": prompt[:200]}
    scored = record if isinstance(record, ScoredTrajectory) else None
    traj: Trajectory = scored.trajectory if scored is not None else record
    out = {"record": "scored_trajectory" if scored is not None else "trajectory",
           "uid": traj.uid, "sample_id": traj.sample_id, "data_source": traj.data_source,
           "kind": traj.kind, "policy_version": traj.policy_version,
           "finish_reason": traj.finish_reason, "turns": len(traj.turns),
           "response_tokens": int(len(traj.response_ids)), "error": traj.error}
    if scored is not None:
        out["reward"] = scored.reward
    return out


def format_entry(entry: dict[str, Any], described: dict[str, Any]) -> str:
    when = dt.datetime.fromtimestamp(entry["ts"], tz=dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC") if entry.get("ts") else "unknown time"
    lines = [f"{entry['dead_id']}  {when}  from {entry['stream']} (group {entry['group']}, "
             f"message {entry['id']}, {entry['deliveries']} deliveries)",
             f"  reason:  {entry['reason']}"]
    if described["record"] is None:
        lines.append(f"  payload: undecodable ({described['bytes']} bytes, starts "
                     f"{described['head'] or '-'}): {described['decode_error']}")
    else:
        fields = ", ".join(f"{k}={v!r}" for k, v in described.items()
                           if k != "record" and v is not None)
        lines.append(f"  payload: {described['record']}: {fields}")
    return "\n".join(lines)


def read_dead(streams: Any, kind: str | None, limit: int) -> list[dict[str, Any]]:
    """Newest-first dead letters, filtered by source stream kind."""
    from services.common.streams import DEAD, parse_dead

    key = streams.key(DEAD)
    out: list[dict[str, Any]] = []
    cursor = "+"
    while len(out) < limit:
        batch = streams.client.xrevrange(key, max=cursor, min="-", count=max(limit, 100))
        if not batch:
            break
        for entry in parse_dead(batch):
            if entry["dead_id"] == cursor:
                continue
            if kind is None or entry["kind"] == kind:
                out.append(entry)
        last = batch[-1][0]
        cursor = last.decode() if isinstance(last, bytes) else str(last)
        if len(batch) < max(limit, 100):
            break
    return out[:limit]


def _dead(args: argparse.Namespace) -> int:
    from services.common.config import load_config
    from services.common.redis_server import RedisUnavailable
    from services.common.streams import RedisStreams

    if args.limit < 1:
        print("forage streams dead: error: --limit must be at least 1", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)  # ConfigError: one line, exit 2 (cli.py)
    redis_cfg = cfg.redis.model_copy(update={"embedded": False})
    try:
        streams = RedisStreams.from_config(redis_cfg)
    except RedisUnavailable as exc:
        print(f"forage streams dead: error: {exc}", file=sys.stderr)
        return 2
    try:
        entries = read_dead(streams, args.stream, args.limit)
    finally:
        streams.close()
    if not entries:
        where = f"{cfg.redis.namespace}:dead" + (f" from {args.stream}" if args.stream else "")
        print(f"no dead-lettered messages in {where}")
        return 0
    for entry in entries:
        described = describe_payload(entry["payload"])
        if args.json:
            print(json.dumps({k: v for k, v in entry.items() if k != "payload"}
                             | {"payload": described}))
        else:
            print(format_entry(entry, described))
    return 0
