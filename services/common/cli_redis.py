"""`forage redis acl [--config FILE] [--out DIR [--rotate]]`: Redis users, one per role.

Without `--out` it prints the ACL rules of the config's namespace (`redis.namespace`) with
every user switched off: what each role may do, for review (deploy/redis/users.acl is this
output for the shipped config). With `--out DIR` it writes what a deployment mounts
(docs/deploy.md, "Security"):

- `users.acl`: the rules with a fresh random password per role, as SHA-256 hashes (Redis's
  `aclfile`; the file holds no password);
- `<role>.password`: one role's password, for the service running as that role
  (`redis.passfile`, REDIS_PASSWORD_FILE);
- `exporter.json`: the exporter's password keyed by the Redis addresses it scrapes
  (redis_exporter's REDIS_PASSWORD_FILE format);
- `autoscaler.username`: KEDA's TriggerAuthentication reads the user name from the Secret.

DIR is made private (0700): the files in it are readable by every user (0644), because compose
bind-mounts them into containers that run as other users (Forage's 1000, redis, the exporter's
59000), and the folder keeps the other users of this machine out. An existing set is only
replaced with `--rotate` (new passwords: restart Redis and the services to take them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from services.common.cli_args import add_config_args, config_from_args

# The addresses the shipped exporters scrape: the compose service and the Kubernetes sidecar,
# over TLS (the deploy files' default) and without (TLS turned off: docs/deploy.md).
EXPORTER_ADDRESSES = ("rediss://redis:6379", "rediss://127.0.0.1:6379",
                      "redis://redis:6379", "redis://127.0.0.1:6379")
ACL_FILE = "users.acl"
EXPORTER_FILE = "exporter.json"


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")
    acl = sub.add_parser("acl", help="the Redis ACL users of a run, one per role; with --out, "
                                     "with fresh passwords")
    add_config_args(acl, required=False)
    acl.add_argument("--out", metavar="DIR", default=None,
                     help="write users.acl, ROLE.password and exporter.json here (private "
                          "folder); without it, print the rules with every user off")
    acl.add_argument("--rotate", action="store_true",
                     help="replace the files of an existing --out with new passwords")
    acl.add_argument("--exporter-address", action="append", metavar="URL", default=None,
                     help="a Redis address the exporter scrapes (repeatable; default: "
                          f"{', '.join(EXPORTER_ADDRESSES)})")
    acl.set_defaults(handler=_acl)


def secret_files(namespace: str, passwords: dict[str, str],
                 exporter_addresses: tuple[str, ...] = EXPORTER_ADDRESSES) -> dict[str, str]:
    """File name -> content of a credential set for `passwords` (role -> password)."""
    from services.common.redis_acl import password_hash, render_acl

    files = {ACL_FILE: render_acl(namespace, {r: password_hash(p) for r, p in passwords.items()})}
    files.update({f"{role}.password": f"{password}\n" for role, password in passwords.items()})
    if "autoscaler" in passwords:  # KEDA takes the user name from a Secret key too
        files["autoscaler.username"] = "autoscaler\n"
    if "exporter" in passwords:
        files[EXPORTER_FILE] = json.dumps(dict.fromkeys(exporter_addresses,
                                                        passwords["exporter"]), indent=2) + "\n"
    return files


def write_secret_files(out: Path, files: dict[str, str], rotate: bool = False,
                       replacement: str = "new passwords") -> None:
    """Write `files` into `out` (made 0700): all or nothing, each replaced atomically.
    `replacement` says what --rotate would write instead, for the refusal's message."""
    existing = sorted(name for name in files if (out / name).exists())
    if existing and not rotate:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}: pass --rotate to "
                              f"replace them with {replacement} (then restart Redis and the "
                              "services), or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    for name, text in files.items():
        temporary = out / f".{name}.tmp"
        temporary.write_text(text)
        temporary.chmod(0o644)
        os.replace(temporary, out / name)


def _acl(args: argparse.Namespace) -> int:
    from services.common.redis_acl import ROLE_NAMES, new_password, render_acl

    namespace = config_from_args(args).redis.namespace
    if args.out is None:
        if args.rotate:
            print("forage redis acl: error: --rotate needs --out DIR (the set to replace)",
                  file=sys.stderr)
            return 2
        print(render_acl(namespace), end="")
        return 0
    passwords = {role: new_password() for role in ROLE_NAMES}
    files = secret_files(namespace, passwords,
                         tuple(args.exporter_address or EXPORTER_ADDRESSES))
    out = Path(args.out)
    try:
        write_secret_files(out, files, rotate=args.rotate)
    except FileExistsError as exc:
        print(f"forage redis acl: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / ACL_FILE} (users of namespace {namespace}: {', '.join(ROLE_NAMES)}) "
          f"and one password file per role in {out}")
    return 0
