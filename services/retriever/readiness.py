"""Wait until a retriever can search: the start-up gate of the services that search through it.

The retriever's /healthz answers 503 while its index loads and 200 once it serves, so a 200 is
the one signal that searches will work (a listening socket is not: the port opens before the
index is in memory)."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TextIO


def healthz_url(retrieve_url: str) -> str:
    """http://retriever:8000/retrieve -> http://retriever:8000/healthz (any path is replaced)."""
    return urllib.parse.urljoin(retrieve_url, "/healthz")


def probe(url: str, timeout_s: float = 5.0) -> tuple[str | None, str | None]:
    """(why not, index id): why is None when `url` answers 200 (else refused, no such name,
    HTTP 503, ...); the index id is the `index_id` that 200's body reports (the identity
    recorded search results are keyed by), None when it reports none. Only the ready line
    shows the id, so an unreadable body never fails the start-up gate."""
    import json

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            if reply.status != 200:
                return f"HTTP {reply.status}", None
            try:
                body = json.loads(reply.read())
            except (OSError, ValueError):
                return None, None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}", None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason), None
    identity = body.get("index_id") if isinstance(body, dict) else None
    return None, identity if isinstance(identity, str) else None


def wait_until_ready(retrieve_url: str, timeout_s: float = 0.0, interval_s: float = 2.0,
                     log_every_s: float = 30.0, out: TextIO | None = None,
                     err: TextIO | None = None) -> bool:
    """Poll the retriever's /healthz until it answers 200 (True) or `timeout_s` passes (False;
    0 waits for ever), printing what it waits for at most every `log_every_s` seconds to `out`
    and, when it gives up, `forage retriever wait: error: ...` to `err` (stdout, stderr)."""
    out = out or sys.stdout
    url = healthz_url(retrieve_url)
    start = time.monotonic()
    logged: float | None = None
    while True:
        why, identity = probe(url)
        now = time.monotonic()
        if why is None:
            print(f"retriever ready at {url} after {now - start:.0f} s"
                  + (f" (index {identity})" if identity else ""), file=out, flush=True)
            return True
        if timeout_s and now - start >= timeout_s:
            print(f"forage retriever wait: error: the retriever at {url} is not ready after "
                  f"{now - start:.0f} s ({why})", file=err or sys.stderr, flush=True)
            return False
        if logged is None or now - logged >= log_every_s:
            print(f"waiting for the retriever at {url} ({why}); {now - start:.0f} s so far",
                  file=out, flush=True)
            logged = now
        time.sleep(interval_s)
