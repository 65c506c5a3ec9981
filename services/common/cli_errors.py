"""How a `forage` command ends on an exception: one line for a failure the user can act on, a
traceback only for a bug.

Expected failures (issue 14: a bad config file, Redis not answering, a port already taken)
used to print tracebacks that buried the one line that mattered. `report_failure` prints
`forage GROUP: error: <what and where>` for them and returns the exit code:

- 2 (`USAGE_ERROR`): the config, an argument or an input path is wrong; running the command
  again cannot help, so `forage up`'s supervisor does not restart it (launch/supervisor.py).
- 75 (`TEMPORARY_FAILURE`, sysexits.h EX_TEMPFAIL): the environment refused for now: Redis
  does not answer (not up yet, restarting) or a port is still held (by a previous instance).
  The same command may work later, so supervisors (`forage up`, compose `restart:`,
  Kubernetes) restart it, as they did when such a failure was a traceback with exit code 1.

Anything else is a bug: the traceback, then a line saying so.
"""

from __future__ import annotations

import errno
import sys
import traceback
from dataclasses import dataclass

from services.common.config import ConfigError

USAGE_ERROR = 2
TEMPORARY_FAILURE = 75

# bind(): the port is taken (by another process or a previous instance still stopping).
_ADDRESS_TAKEN = {errno.EADDRINUSE}
# bind(): the host is not an address of this machine, or the port needs privileges.
_ADDRESS_INVALID = {errno.EADDRNOTAVAIL}
# The filesystem refused a named path (no permission, read-only), or is full.
_FILESYSTEM = {errno.EACCES, errno.EPERM, errno.EROFS}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


@dataclass(frozen=True)
class Failure:
    message: str
    code: int


def expected_failure(exc: BaseException) -> Failure | None:
    """The one line and exit code for an expected failure, or None for a bug."""
    if isinstance(exc, ConfigError):
        return Failure(str(exc), USAGE_ERROR)
    found = _redis_failure(exc)
    if found is not None:
        return found
    if isinstance(exc, OSError) and exc.errno is not None:
        text = _os_error_text(exc)
        if exc.errno in _ADDRESS_TAKEN:
            return Failure(f"{text} (another process listens there; free the port or choose "
                           "another in the config)", TEMPORARY_FAILURE)
        if exc.errno in _ADDRESS_INVALID:
            return Failure(f"{text} (not an address of this machine; check the host in the "
                           "config)", USAGE_ERROR)
        if exc.errno in _DISK_FULL or (exc.errno in _FILESYSTEM and exc.filename is not None):
            return Failure(text, USAGE_ERROR)
    return None


def report_failure(group: str, exc: BaseException) -> int:
    """Print what `exc` means for the user of `forage GROUP`; returns the exit code."""
    from services.common.redact import redact_text

    failure = expected_failure(exc)
    if failure is not None:
        print(f"forage {group}: error: {redact_text(failure.message)}", file=sys.stderr)
        return failure.code
    # A URL's password in an exception's message (redis-py, httpx) is not printed.
    print(redact_text("".join(traceback.format_exception(exc))), end="", file=sys.stderr)
    print(f"forage {group}: internal error ({type(exc).__name__}); this is a bug in Forage: "
          "please report it with the traceback above", file=sys.stderr)
    return 1


def _os_error_text(exc: OSError) -> str:
    """`strerror: filename` without the `[Errno N]` prefix; a message that a listener put in
    `strerror` (naming the address it tried) is kept whole."""
    text = exc.strerror or str(exc)
    if exc.filename is not None:
        text = f"{exc.filename}: {text}"
    return text


def _redis_failure(exc: BaseException) -> Failure | None:
    if type(exc).__module__.split(".")[0] not in ("redis", "services"):
        return None
    import redis

    from services.common.redis_connect import RedisAuthConfigError
    from services.common.redis_server import RedisUnavailable

    said = " ".join(str(exc).split())
    if isinstance(exc, RedisUnavailable):
        return Failure(said, TEMPORARY_FAILURE)
    if isinstance(exc, RedisAuthConfigError):
        return Failure(said, USAGE_ERROR)
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return Failure(f"Redis refused the credentials: {said} (redis.username and "
                       "redis.passfile, REDIS_USERNAME and REDIS_PASSWORD_FILE, or the user "
                       "and password in redis.url)", USAGE_ERROR)
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return Failure(f"Redis refused a command: {said} (this service runs as an ACL user "
                       "without that permission: check redis.username)", USAGE_ERROR)
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return Failure(f"Redis does not answer: {said} (redis.url or REDIS_URL)",
                       TEMPORARY_FAILURE)
    return None
