"""Tools from Model Context Protocol servers (`rollout.mcp_servers`, docs/rollout.md).

Through the official `mcp` Python SDK (the optional extra: `pip install -e .[mcp]`). The SDK is
async and the agent loop is not, so each replica runs one asyncio event loop in a background
thread (`McpHub`); the loop's ToolRunner submits calls to it with `run_coroutine_threadsafe`
and polls the futures, so the engine never waits on a server.

One `_Connection` per server holds its transport (a stdio subprocess, or a streamable HTTP
session) and its `ClientSession` inside one task, because the SDK's anyio task groups must be
entered and left by the same task; calls run as other tasks on the same session. A call that
fails because the connection is gone (the server died, the HTTP endpoint went away) marks the
connection dead; the next attempt (a retry, or a later call) connects again: a new subprocess
for stdio, a new session for HTTP. The tool list is read once, at replica start.

A `url` server's `headers` (auth: `Authorization: Bearer ${MCP_TOKEN}`) are expanded from the
environment once, when the hub is built (an unset variable stops the replica, naming the
variable, never a value), and go with every request through an httpx client of the SDK's own
making (`create_mcp_http_client`, its default timeouts) handed to `streamable_http_client`.
The expanded values live only in the connection; nothing logs them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AsyncExitStack
from typing import Any

from services.common.config.rollout import McpServer, expand_headers
from services.rollout.tool_runner import BACKOFF_S, Outcome, ToolLoadError, result_text

log = logging.getLogger("forage.rollout.mcp")

try:
    import mcp  # noqa: F401
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client
    from mcp.shared.exceptions import MCPError
except ImportError as _exc:  # the optional extra
    _MISSING: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    _MISSING = None


class ConnectionLost(Exception):
    """The server cannot be reached or its connection ended: worth a reconnect and a retry."""


class _Connection:
    """One server's transport + session, (re)opened on demand inside the hub's event loop."""

    def __init__(self, server: McpServer, headers: dict[str, str] | None = None) -> None:
        self.server = server
        # expanded from the environment (credentials): kept here only, never logged
        self._headers = dict(headers or {})
        self.session: Any = None
        self._holder: asyncio.Task | None = None
        self._dead: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self.connects = 0

    async def ensure(self) -> Any:
        """The live session, connecting first when there is none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.session is not None and self._holder is not None and not self._holder.done():
                return self.session
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            self._holder = asyncio.create_task(self._hold(ready))
            try:
                return await asyncio.wait_for(asyncio.shield(ready),
                                              self.server.connect_timeout_s)
            except asyncio.TimeoutError:
                self._holder.cancel()
                raise ConnectionLost(f"no answer within {self.server.connect_timeout_s:g}s "
                                     "while connecting") from None

    def mark_dead(self) -> None:
        if self._dead is not None:
            self._dead.set()
        self.session = None

    async def close(self) -> None:
        self.mark_dead()
        if self._holder is not None:
            try:
                await asyncio.wait_for(self._holder, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                self._holder.cancel()

    def __repr__(self) -> str:  # no header values in any repr
        return f"_Connection({self.server.name!r}, headers={sorted(self._headers)})"

    def _transport(self, http_client: Any = None) -> Any:
        server = self.server
        if server.url:
            return streamable_http_client(server.url, http_client=http_client)
        params = StdioServerParameters(command=server.command, args=list(server.args),
                                       env=dict(server.env) or None)
        # The server's stderr (its logs) goes nowhere: a chatty server must not fill the
        # replica's log, and its failures reach the model as observations anyway.
        return stdio_client(params, errlog=open(os.devnull, "w"))  # noqa: SIM115

    async def _hold(self, ready: asyncio.Future) -> None:
        """Open the transport and the session, hand the session over, and keep both open
        until the connection is marked dead or the hub closes (same task: anyio's rule)."""
        self._dead = dead = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                client = None
                if self.server.url and self._headers:
                    # a client the transport does not own: this stack closes it, after it
                    client = await stack.enter_async_context(
                        create_mcp_http_client(headers=self._headers))
                streams = await stack.enter_async_context(self._transport(client))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                self.session = session
                self.connects += 1
                ready.set_result(session)
                await dead.wait()
        except BaseException as exc:  # noqa: BLE001 - a transport's exit may raise anything
            if not ready.done():
                ready.set_exception(ConnectionLost(_reason(exc)))
        finally:
            self.session = None


def _headers(server: McpServer, index: int,
             environ: Any = None) -> dict[str, str]:
    """A server's headers with their `${NAME}` references expanded from the environment;
    ToolLoadError naming the unset variables (never a value)."""
    expanded, missing = expand_headers(server.headers, os.environ if environ is None else environ)
    if missing:
        names = sorted(name for name, value in server.headers.items()
                       if any("${" + variable + "}" in value for variable in missing))
        raise ToolLoadError(f"rollout.mcp_servers[{index}] ({server.name}): header(s) "
                            f"{', '.join(names)} need the environment variable(s) "
                            f"{', '.join(missing)}, which are not set")
    return expanded


def _reason(exc: BaseException) -> str:
    """A one-line reason, looking inside exception groups (anyio wraps transport errors)."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


class McpBackend:
    """One MCP tool as a ToolRunner backend."""

    def __init__(self, hub: McpHub, server: str, tool: str, retries: int) -> None:
        self.hub, self.server, self.tool, self.retries = hub, server, tool, retries

    def start(self, arguments: dict[str, Any], deadline: float,
              release: Callable[[], None]) -> Future:
        future = self.hub.submit(self.hub.call(self.server, self.tool, arguments, deadline,
                                               self.retries))
        future.add_done_callback(lambda _: release())
        return future


class McpHub:
    """A replica's MCP servers and the event loop (one background thread) that talks to them."""

    def __init__(self, servers: list[McpServer]) -> None:
        if _MISSING is not None:
            raise ToolLoadError("rollout.mcp_servers needs the mcp package: pip install -e "
                                f"'.[mcp]' (or pip install mcp) ({_MISSING})")
        self.connections = {server.name: _Connection(server, _headers(server, index))
                            for index, server in enumerate(servers)}
        if len(self.connections) != len(servers):
            raise ToolLoadError("rollout.mcp_servers: two servers have the same name")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mcp-loop",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, coroutine: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def backend(self, server: str, tool: str, retries: int) -> McpBackend:
        return McpBackend(self, server, tool, retries)

    def list_tools(self, server: str, where: str) -> list[Any]:
        """The server's tools (connecting first); ToolLoadError naming `where` otherwise."""
        connection = self.connections[server]
        limit = connection.server.connect_timeout_s
        try:
            tools = self.submit(self._list(connection)).result(timeout=limit + 1.0)
        except ConnectionLost as exc:
            raise ToolLoadError(f"{where}: cannot connect: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - one line for any failure
            raise ToolLoadError(f"{where}: cannot list tools: {_reason(exc)}") from None
        include = connection.server.include
        if include:
            missing = sorted(set(include) - {tool.name for tool in tools})
            if missing:
                raise ToolLoadError(f"{where}: include names tools the server does not list: "
                                    f"{missing}")
            tools = [tool for tool in tools if tool.name in include]
        return tools

    async def _list(self, connection: _Connection) -> list[Any]:
        session = await connection.ensure()
        tools: list[Any] = []
        cursor = None
        while True:  # the list may come in pages
            page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
            tools.extend(page.tools)
            cursor = getattr(page, "next_cursor", None)
            if not cursor:
                return tools

    async def call(self, server: str, tool: str, arguments: dict[str, Any], deadline: float,
                   retries: int) -> Outcome:
        """One call with its retries: a lost connection is reconnected and the call retried
        while retries and time remain; the tool's own error (isError) is its answer."""
        connection = self.connections[server]
        attempt = 0
        while True:
            try:
                return await self._call_once(connection, tool, arguments, deadline, attempt)
            except ConnectionLost as exc:
                connection.mark_dead()
                pause = BACKOFF_S * 2 ** attempt
                if attempt >= retries or time.monotonic() + pause >= deadline:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    return Outcome(f"Error: tool {tool} failed{tries}: MCP server {server} "
                                   f"is unreachable ({exc})", False, "error", attempt)
                attempt += 1
                await asyncio.sleep(pause)

    async def _call_once(self, connection: _Connection, tool: str, arguments: dict[str, Any],
                         deadline: float, attempt: int) -> Outcome:
        session = await connection.ensure()
        remaining = max(0.001, deadline - time.monotonic())
        try:
            result = await asyncio.wait_for(
                session.call_tool(tool, arguments, read_timeout_seconds=remaining), remaining)
        except asyncio.TimeoutError:
            raise  # the runner answers timeouts; the connection may be fine
        except MCPError as exc:
            if _is_connection_error(exc):
                raise ConnectionLost(_reason(exc)) from None
            return Outcome(f"Error: tool {tool} failed: {_reason(exc)}", False, "tool_error",
                           attempt)
        except Exception as exc:  # noqa: BLE001 - transport errors of any kind
            raise ConnectionLost(_reason(exc)) from None
        text = _content_text(result)
        if getattr(result, "is_error", False):
            return Outcome(f"Error: {text}" if not text.startswith("Error") else text, False,
                           "tool_error", attempt)
        return Outcome(text, True, "ok", attempt)

    def close(self) -> None:
        """Close every session (stdio servers are stopped) and the event loop."""
        if self._closed:
            return
        self._closed = True

        async def close_all() -> None:
            await asyncio.gather(*(c.close() for c in self.connections.values()),
                                 return_exceptions=True)

        try:
            self.submit(close_all()).result(timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.warning("closing MCP connections: %s", _reason(exc))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


def _is_connection_error(exc: Exception) -> bool:
    code = getattr(getattr(exc, "error", None), "code", None)
    if code is None:
        code = getattr(exc, "code", None)
    return code == -32000  # mcp_types.CONNECTION_CLOSED


def _content_text(result: Any) -> str:
    """The text of a CallToolResult: text parts joined; other parts named, not inlined; the
    structured content as JSON when there is no text."""
    parts = []
    for item in getattr(result, "content", None) or []:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(item, 'type', 'content')}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        return result_text(result.structured_content)
    return result_text("\n".join(parts))
