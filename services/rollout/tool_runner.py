"""User and MCP tools of `rollout.protocol: tool_calls`: loading and running them with limits
(docs/rollout.md, "Tool calls").

`Toolbox.build` resolves `rollout.tools` and `rollout.mcp_servers` when a replica starts: the
built-ins (`search`, `calculator`: run by the agent loop itself), user functions loaded like
reward plug-ins, and the tools each MCP server lists. Any problem is a `ToolLoadError` whose
one-line message names the config entry.

`ToolRunner` runs the calls of user and MCP tools beside the engine loop, never inside it: the
loop submits a call and polls for finished ones between engine steps. Per tool:

- `timeout_s` bounds a call from its submission (waiting for a slot and retries included); a
  call still running at its deadline is answered `Error: tool X timed out after Ns` and the
  loop goes on. Only that call pays: its neighbours, the batch and the replica do not wait.
- `max_concurrency` calls of the tool run at once; others queue (their deadline still counts).
- `retries` further attempts follow a transient failure (OSError, ToolRetry, a lost MCP
  connection), with a short doubling backoff, inside the deadline.

Why threads and not a process pool: a user tool is usually I/O (an HTTP API, a database), its
arguments and result are JSON and cheap, and a process pool would have to pickle results
across processes (which Forage never unpickles) or re-implement a JSON channel, and spawn a
process per killed call. The cost is that a hung Python function cannot be killed: its daemon
thread is abandoned (it never blocks the replica's exit) and keeps its concurrency slot until
it returns, so a tool that hangs forever occupies at most `max_concurrency` threads, and its
later calls time out in the queue while every other tool keeps running.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from services.common.config.rollout import McpServer, ToolLimits, UserTool
from services.common.plugins import load_ref
from services.common.tool_calls import ToolCall
from services.common.tools import (
    TOOL_REGISTRY,
    ToolRetry,
    ToolSpec,
    check_parameters,
    check_tool_name,
)

log = logging.getLogger("forage.rollout.tools")

BACKOFF_S = 0.05  # first retry's pause; doubles each retry
# Longest tool result kept as text before the loop cuts it to max_obs_length tokens: a tool
# returning megabytes must not cost a tokenizer pass over all of them.
MAX_RESULT_CHARS = 200_000

# How a call that ran ended, the `outcome` label of forage_rollout_tool_calls_total: `ok`,
# `tool_error` (the tool's own error), `error` (transient failures, retries spent) or `timeout`.
# A call that could not be parsed is counted under its tool_calls.ErrorKind instead
# (docs/rollout.md lists both).
ToolOutcome = Literal["ok", "tool_error", "error", "timeout"]


class ToolLoadError(ValueError):
    """A user or MCP tool that cannot be loaded; the message names the config entry."""


@dataclass(frozen=True)
class Outcome:
    """What one call came to: the observation text and how it ended."""

    text: str
    ok: bool
    outcome: ToolOutcome  # never `timeout`: the runner answers a call past its deadline
    retries: int = 0


class Backend(Protocol):
    """Runs one call; `start` returns at once, `release` is called when the work truly ended
    (its concurrency slot is then free: for a thread, when the function returned)."""

    def start(self, arguments: dict[str, Any], deadline: float,
              release: Callable[[], None]) -> Future: ...


def result_text(value: Any) -> str:
    """A tool's return value as the model reads it: strings as they are, anything else as
    JSON (str() when it is not JSON-serialisable); cut to MAX_RESULT_CHARS."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    return text[:MAX_RESULT_CHARS]


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, ToolRetry))


class FunctionBackend:
    """A user function, each call in its own daemon thread (see the module docstring)."""

    def __init__(self, name: str, function: Callable[..., Any], retries: int) -> None:
        self.name = name
        self.function = function
        self.retries = retries

    def start(self, arguments: dict[str, Any], deadline: float,
              release: Callable[[], None]) -> Future:
        future: Future = Future()
        thread = threading.Thread(target=self._run, args=(future, arguments, deadline, release),
                                  name=f"tool-{self.name}", daemon=True)
        thread.start()
        return future

    def _run(self, future: Future, arguments: dict[str, Any], deadline: float,
             release: Callable[[], None]) -> None:
        try:
            outcome = self._attempts(future, arguments, deadline)
        except BaseException as exc:  # noqa: BLE001 - never let a tool kill its thread silently
            outcome = Outcome(f"Error: tool {self.name} failed: {type(exc).__name__}", False,
                              "tool_error")
        finally:
            release()
        try:
            future.set_result(outcome)
        except InvalidStateError:  # timed out meanwhile: the loop already answered the call
            pass

    def _attempts(self, future: Future, arguments: dict[str, Any], deadline: float) -> Outcome:
        attempt = 0
        while True:
            try:
                return Outcome(result_text(self.function(**arguments)), True, "ok", attempt)
            except Exception as exc:  # the tool's error is the model's observation
                reason = f"{type(exc).__name__}: {exc}"[:500]
                pause = BACKOFF_S * 2 ** attempt
                if (not is_transient(exc) or attempt >= self.retries or future.done()
                        or time.monotonic() + pause >= deadline):
                    if is_transient(exc):
                        tries = f" after {attempt + 1} attempts" if attempt else ""
                        return Outcome(f"Error: tool {self.name} failed{tries}: {reason}",
                                       False, "error", attempt)
                    return Outcome(f"Error: tool {self.name} failed: {reason}", False,
                                   "tool_error", attempt)
                attempt += 1
                time.sleep(pause)


@dataclass
class _Pending:
    key: Any
    name: str
    arguments: dict[str, Any]
    submitted: float
    deadline: float
    future: Future | None = None


@dataclass(frozen=True)
class ToolResult:
    """A finished call, for the loop: `key` is what it submitted the call with."""

    key: Any
    name: str
    text: str
    ok: bool
    outcome: ToolOutcome
    seconds: float
    retries: int = 0


class ToolRunner:
    """Runs user and MCP tool calls with per-tool timeouts, concurrency limits and retries.
    Only the loop's thread calls submit/poll/wait; backends finish on their own threads."""

    def __init__(self, backends: Mapping[str, Backend], limits: Mapping[str, ToolLimits]) -> None:
        self.backends = dict(backends)
        self.limits = dict(limits)
        self._queued: dict[str, deque[_Pending]] = {name: deque() for name in self.backends}
        self._running: list[_Pending] = []
        self._active: dict[str, int] = dict.fromkeys(self.backends, 0)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def __contains__(self, name: str) -> bool:
        return name in self.backends

    @property
    def pending(self) -> int:
        """Calls submitted and not yet returned by poll()."""
        return len(self._running) + sum(len(queue) for queue in self._queued.values())

    def submit(self, key: Any, call: ToolCall) -> None:
        now = time.monotonic()
        self._queued[call.name].append(_Pending(key, call.name, dict(call.arguments), now,
                                                now + self.limits[call.name].timeout_s))
        self._start_queued()

    def poll(self) -> list[ToolResult]:
        """Finished and timed-out calls (never blocks)."""
        now = time.monotonic()
        done: list[ToolResult] = []
        still: list[_Pending] = []
        for item in self._running:
            assert item.future is not None
            if item.future.done() and not item.future.cancelled():
                error = item.future.exception()
                if isinstance(error, (TimeoutError, asyncio.TimeoutError)):  # its own deadline
                    done.append(self._timed_out(item, now))
                    continue
                if error is not None:  # a backend bug: still only this call's answer
                    outcome = Outcome(f"Error: tool {item.name} failed: "
                                      f"{type(error).__name__}", False, "error")
                else:
                    outcome = item.future.result()
                done.append(ToolResult(item.key, item.name, outcome.text, outcome.ok,
                                       outcome.outcome, now - item.submitted, outcome.retries))
            elif now >= item.deadline:
                item.future.cancel()  # MCP: cancels the request; a thread is abandoned
                done.append(self._timed_out(item, now))
            else:
                still.append(item)
        self._running = still
        for queue in self._queued.values():
            while queue and now >= queue[0].deadline:
                done.append(self._timed_out(queue.popleft(), now))
        self._start_queued()
        return done

    def wait(self, timeout: float) -> None:
        """Sleep until a call may have finished or timed out, at most `timeout` seconds: the
        loop calls it only while the engine has nothing to decode."""
        deadlines = [item.deadline for item in self._running]
        deadlines += [queue[0].deadline for queue in self._queued.values() if queue]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - time.monotonic()))
        with self._changed:
            if any(item.future is not None and item.future.done() for item in self._running):
                return
            self._changed.wait(timeout)

    def _timed_out(self, item: _Pending, now: float) -> ToolResult:
        limit = self.limits[item.name].timeout_s
        return ToolResult(item.key, item.name,
                          f"Error: tool {item.name} timed out after {limit:g}s", False,
                          "timeout", now - item.submitted)

    def _start_queued(self) -> None:
        for name, queue in self._queued.items():
            while queue:
                with self._lock:
                    if self._active[name] >= self.limits[name].max_concurrency:
                        break
                    self._active[name] += 1
                item = queue.popleft()
                item.future = self.backends[name].start(item.arguments, item.deadline,
                                                        self._releaser(name))
                item.future.add_done_callback(self._notify)
                self._running.append(item)

    def _releaser(self, name: str) -> Callable[[], None]:
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._changed:
                self._active[name] -= 1
                self._changed.notify_all()
        return release

    def _notify(self, _future: Future) -> None:
        with self._changed:
            self._changed.notify_all()


@dataclass
class Toolbox:
    """Every tool of a replica: declarations for the template and the parser, and a runner
    for the user and MCP tools (None when there are none)."""

    specs: list[ToolSpec]
    runner: ToolRunner | None = None
    hub: Any = None  # services.rollout.mcp_tools.McpHub when mcp_servers are configured
    origin: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @classmethod
    def build(cls, entries: Sequence[str | UserTool | Mapping[str, Any]],
              mcp_servers: Sequence[McpServer | Mapping[str, Any]] = ()) -> Toolbox:
        """Load everything `rollout.tools` and `rollout.mcp_servers` name (replica start)."""
        specs: list[ToolSpec] = []
        origin: dict[str, str] = {}
        backends: dict[str, Backend] = {}
        limits: dict[str, ToolLimits] = {}

        def declare(spec: ToolSpec, where: str) -> None:
            if spec.name in origin:
                raise ToolLoadError(f"{where}: tool name {spec.name!r} is already declared by "
                                    f"{origin[spec.name]}")
            origin[spec.name] = where
            specs.append(spec)

        for index, raw in enumerate(entries):
            where = f"rollout.tools[{index}]"
            if isinstance(raw, str):
                if raw not in TOOL_REGISTRY:
                    raise ToolLoadError(f"{where}: unknown tool {raw!r}; built-ins: "
                                        f"{sorted(TOOL_REGISTRY)}")
                declare(TOOL_REGISTRY[raw], f"{where} (built-in {raw})")
                continue
            entry = raw if isinstance(raw, UserTool) else _validated(UserTool, raw, where)
            where = f"{where} ({entry.function})"
            try:
                function = load_ref(entry.function, where)
            except ValueError as exc:
                raise ToolLoadError(str(exc)) from None
            description = entry.description or _doc(function)
            declare(ToolSpec(entry.name, description, dict(entry.parameters)), where)
            backends[entry.name] = FunctionBackend(entry.name, function, entry.retries)
            limits[entry.name] = entry
        hub = None
        if mcp_servers:
            from services.rollout.mcp_tools import McpHub  # the optional `mcp` extra

            servers = [s if isinstance(s, McpServer)
                       else _validated(McpServer, s, f"rollout.mcp_servers[{i}]")
                       for i, s in enumerate(mcp_servers)]
            hub = McpHub(servers)
            try:
                for index, server in enumerate(servers):
                    where = f"rollout.mcp_servers[{index}] ({server.name})"
                    for tool in hub.list_tools(server.name, where):
                        name = server.prefix + tool.name
                        problem = check_tool_name(name) or check_parameters(tool.input_schema)
                        if problem:
                            raise ToolLoadError(f"{where}: tool {tool.name!r}: {problem}")
                        declare(ToolSpec(name, tool.description or "", dict(tool.input_schema)),
                                where)
                        backends[name] = hub.backend(server.name, tool.name, server.retries)
                        limits[name] = server
            except BaseException:
                hub.close()
                raise
        runner = ToolRunner(backends, limits) if backends else None
        return cls(specs, runner, hub, origin)

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()


def _validated(model: Any, raw: Any, where: str) -> Any:
    from pydantic import ValidationError

    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ToolLoadError(f"{where}: {message}") from None


def _doc(function: Callable[..., Any]) -> str:
    """The first paragraph of the function's docstring: what the model is told it does."""
    doc = inspect.getdoc(function) or ""
    return " ".join(doc.split("\n\n")[0].split())
