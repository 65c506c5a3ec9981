"""`forage tls certs --out DIR [--rotate]`: the certificates the deploy files' TLS runs on.

A separate command from `forage redis acl`: the certificates serve the weight sync as well as
Redis, name the deployment's hosts rather than a run's namespace, and expire on their own
schedule, so rotating passwords and rotating certificates stay independent. DIR
(docs/deploy.md, "Security"; compose's secrets and the Kubernetes Secret forage-tls read it):

- `ca.crt`: the private CA every client trusts (its key is not kept: see tls_certs.py);
- `redis.crt` / `redis.key`: Redis's certificate, for `redis` and the Service's DNS names;
- `learner.crt` / `learner.key`: the learner's weight server, for `learner` likewise;
- `relay.crt` / `relay.key`: every rollout replica's weight relay, for `forage-relay`
  (`rollout.weight_relay_tls_name`);
- `autoscaler.tls`: `enable`, the value KEDA's TriggerAuthentication reads to dial Redis with
  TLS (a Secret key, as its other parameters are).

Like `forage redis acl`'s folder, DIR is 0700 and its files 0644: compose bind-mounts each file
into containers that run as other users (Redis's, Forage's 1000, the exporter's). An existing
set is only replaced with `--rotate` (then restart Redis and the services together).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

AUTOSCALER_FILE = "autoscaler.tls"
NAMESPACE = "forage"  # kustomization.yaml's namespace


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")
    certs = sub.add_parser("certs", help="a private CA and the certificates of Redis, the "
                                         "learner's weight server and the weight relays")
    certs.add_argument("--out", metavar="DIR", required=True,
                       help="write ca.crt and a certificate and key per server here (private "
                            "folder)")
    certs.add_argument("--rotate", action="store_true",
                       help="replace the files of an existing --out with a new CA and "
                            "certificates")
    certs.add_argument("--namespace", default=NAMESPACE,
                       help="the Kubernetes namespace whose Service names the certificates "
                            f"carry (default: {NAMESPACE})")
    certs.add_argument("--redis-host", action="append", default=[], metavar="NAME",
                       help="another name or address clients reach Redis by (repeatable)")
    certs.add_argument("--learner-host", action="append", default=[], metavar="NAME",
                       help="another name or address replicas reach the learner by "
                            "(repeatable)")
    certs.add_argument("--days", type=int, default=365,
                       help="how long the certificates are valid (default: 365)")
    certs.set_defaults(handler=_certs)


def cert_files(namespace: str = NAMESPACE, redis_hosts: tuple[str, ...] = (),
               learner_hosts: tuple[str, ...] = (), days: int = 365):
    """(file name -> content, expiry) of a fresh set: what `--out` receives."""
    from services.common.tls_certs import RELAY, RELAY_NAME, make_cert_set, server_names

    made = make_cert_set({
        "redis": server_names("redis", namespace, redis_hosts),
        "learner": server_names("learner", namespace, learner_hosts),
        RELAY: [RELAY_NAME],
    }, days=days)
    return {**made.files, AUTOSCALER_FILE: "enable\n"}, made.not_after


def _certs(args: argparse.Namespace) -> int:
    from services.common.cli_redis import write_secret_files

    def fail(message: str) -> int:
        print(f"forage tls certs: error: {message}", file=sys.stderr)
        return 2

    if args.days < 1:
        return fail(f"--days must be at least 1 (got {args.days})")
    hosts = [*args.redis_host, *args.learner_host, args.namespace]
    if any(not host.strip() or any(c.isspace() for c in host) for host in hosts):
        return fail("--namespace, --redis-host and --learner-host take a name without spaces")
    files, not_after = cert_files(args.namespace, tuple(args.redis_host),
                                  tuple(args.learner_host), args.days)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return fail(f"--out {out} is a file, not a folder")
    try:
        write_secret_files(out, files, rotate=args.rotate,
                           replacement="a new CA and certificates")
    except FileExistsError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or type(exc).__name__}")
    print(f"wrote {out / 'ca.crt'} and the certificates of redis, learner and the weight "
          f"relays in {out} (namespace {args.namespace}; valid until {not_after:%Y-%m-%d})")
    return 0
