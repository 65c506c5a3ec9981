"""MCP tools in `rollout.protocol: tool_calls` (services/rollout/mcp_tools.py) against a real
MCP server (tests/rollout/mcp_server.py, the SDK's own server) over stdio and streamable HTTP
on loopback, through the real agent loop and tiny policy (turns scripted with the engine's
`forced_tokens` hook), including a server that dies mid-run."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.suite_rules import import_or_skip

import_or_skip("mcp", "the mcp extra (make install: the dev extra brings it; pip install -e .[mcp])")

from services.common.ports import free_port  # noqa: E402
from services.common.tool_calls import ToolCall  # noqa: E402
from services.common.trajectory import PromptGroup  # noqa: E402
from services.rollout.agent import AgentLoop, LoopSettings  # noqa: E402
from services.rollout.tool_runner import Toolbox, ToolLoadError  # noqa: E402

from .test_agent import spans  # noqa: E402

SERVER = str(Path(__file__).with_name("mcp_server.py"))
ANSWER = "<answer> Corvale </answer>"


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def play(engine, turns: list[str], servers: list[dict], max_turns: int = 4):
    """Run one trajectory whose turns are `turns`; returns it, its observations and the hub's
    connection counts (read before the loop closes its servers)."""
    tok = engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    encoded = [tok.encode(t, add_special_tokens=False) + ([] if "</tool_call>" in t else [eos])
               for t in turns]
    engine.forced_tokens = lambda r: (encoded[min(len(r.tag[1].turns), len(encoded) - 1)]
                                      if r.tag[0] == "turn" else None)
    loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=(), max_turns=max_turns,
                                          mcp_servers=tuple(servers)), None)
    group = PromptGroup(uid="m", data_source="nq", ground_truth={"target": ["Corvale"]},
                        prompt="Where was Brixol born?", n=1)
    try:
        [traj] = loop.run([group])
        connects = {name: c.connects for name, c in loop.toolbox.hub.connections.items()}
    finally:
        loop.close()
        engine.forced_tokens = None
    seen = [tok.decode(traj.response_ids[a:b].tolist()) for a, b in spans(traj.loss_mask, 0)]
    return traj, seen, connects


def tool_message(text: str) -> str:
    return f"<|im_start|>tool\n{text}<|im_end|>"


def test_stdio_server_in_the_loop_and_a_server_that_dies(engine):
    stdio = {"name": "facts", "command": sys.executable, "args": [SERVER], "timeout_s": 20,
             "retries": 0}
    turns = [call_text("add", {"a": 1900, "b": 7}),
             call_text("die", {}),  # the server exits mid-call
             call_text("lookup", {"key": "Brixol"}),  # a new server process answers
             call_text("add", {"a": "x", "b": 1}),  # refused by the schema the server listed
             ANSWER]
    traj, seen, connects = play(engine, turns, [stdio], max_turns=5)
    assert traj.finish_reason == "answer" and traj.error is None
    assert tool_message("1907") in seen[0]
    assert tool_message("Error: tool die failed: MCP server facts is unreachable "
                        "(MCPError: Connection closed)") in seen[1]
    assert tool_message("Brixol was born in Corvale.") in seen[2]
    assert "Error: bad arguments for add: a: 'x' is not of type 'integer'" in seen[3]
    assert connects == {"facts": 2}
    stats = traj.extra["tools"]
    assert stats["add"]["calls"] == 2 and stats["add"]["failures"] == 1  # one refused by schema
    assert stats["die"]["failures"] == 1
    assert stats["lookup"]["failures"] == 0


class HttpServer:
    """The test server over streamable HTTP on loopback; `start()` again after `kill()`.
    `env`: added to its environment (FORAGE_TEST_MCP_TOKEN makes it require a bearer token)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, SERVER, "http", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the MCP test server exited"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the MCP test server did not listen")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def http_server():
    server = HttpServer()
    server.start()
    yield server
    server.kill()


def drain(runner, limit_s: float = 20.0) -> dict:
    results, deadline = {}, time.monotonic() + limit_s
    while runner.pending and time.monotonic() < deadline:
        runner.wait(0.05)
        for result in runner.poll():
            results[result.key] = result
    return results


def test_http_server_in_the_loop(engine, http_server):
    server = {"name": "web", "url": http_server.url, "prefix": "web_", "timeout_s": 10}
    turns = [call_text("web_lookup", {"key": "Tamra"}), call_text("lookup", {"key": "x"}), ANSWER]
    traj, seen, connects = play(engine, turns, [server])
    assert traj.finish_reason == "answer"
    assert tool_message("Tamra was born in Dunmore.") in seen[0]
    assert "unknown tool 'lookup'. Available tools: web_add, web_die, web_lookup, web_slow" in seen[1]
    assert connects == {"web": 1}


def test_http_server_dies_and_comes_back_timeouts_and_names(http_server):
    base = {"name": "web", "url": http_server.url, "timeout_s": 10, "retries": 0}
    box = Toolbox.build([], [base, {**base, "name": "web2", "prefix": "b_", "include": ["add"]}])
    try:
        assert box.names == ["add", "lookup", "slow", "die", "b_add"]
        runner = box.runner
        runner.submit("sum", ToolCall("add", {"a": 2, "b": 3}))
        runner.submit("b", ToolCall("b_add", {"a": 1, "b": 1}))
        results = drain(runner)
        assert results["sum"].text == "5" and results["b"].text == "2"
        http_server.kill()
        runner.submit("down", ToolCall("add", {"a": 2, "b": 3}))
        down = drain(runner)["down"]
        assert not down.ok and down.outcome == "error"
        assert down.text.startswith("Error: tool add failed: MCP server web is unreachable")
        http_server.start()  # the same port: a later call reconnects
        runner.submit("back", ToolCall("add", {"a": 2, "b": 3}))
        assert drain(runner)["back"].text == "5"
        assert box.hub.connections["web"].connects == 2
    finally:
        box.close()
    # a slow call costs its own call a timeout (the request is cancelled), and the same
    # session answers the next call
    box = Toolbox.build([], [{**base, "timeout_s": 0.3}])
    try:
        box.runner.submit("slow", ToolCall("slow", {"seconds": 1}))
        slow = drain(box.runner)["slow"]
        assert slow.outcome == "timeout" and slow.text == "Error: tool slow timed out after 0.3s"
        time.sleep(1.0)  # the test server runs a sync tool on its own loop: let it finish
        box.runner.submit("after", ToolCall("lookup", {"key": "Brixol"}))
        assert drain(box.runner)["after"].ok
        assert box.hub.connections["web"].connects == 1
    finally:
        box.close()


def test_collisions_and_unreachable_servers_fail_at_start(http_server):
    base = {"name": "web", "url": http_server.url}
    with pytest.raises(ToolLoadError, match=r"^rollout.mcp_servers\[1\] \(again\): tool name "
                                            r"'add' is already declared by "
                                            r"rollout.mcp_servers\[0\] \(web\)$"):
        Toolbox.build([], [base, {**base, "name": "again"}])
    with pytest.raises(ToolLoadError, match=r"include names tools the server does not list: "
                                            r"\['calculator'\]$"):
        Toolbox.build(["calculator"], [{**base, "include": ["calculator"]}])
    gone = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(ToolLoadError) as caught:
        Toolbox.build([], [{"name": "gone", "url": gone, "connect_timeout_s": 5}])
    assert str(caught.value).startswith("rollout.mcp_servers[0] (gone): cannot connect: ")
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------- auth headers

TOKEN = "s3cret-token-value"


@pytest.fixture()
def auth_server():
    """The test server behind bearer auth: 401 without `Authorization: Bearer TOKEN` and
    `X-Tenant: acme`."""
    server = HttpServer({"FORAGE_TEST_MCP_TOKEN": TOKEN, "FORAGE_TEST_MCP_TENANT": "acme"})
    server.start()
    yield server
    server.kill()


def test_headers_reach_an_http_server_that_requires_a_token(auth_server, monkeypatch, caplog):
    import httpx

    assert httpx.post(auth_server.url, json={}).status_code == 401  # the server does check
    caplog.set_level(logging.DEBUG)
    base = {"name": "secure", "url": auth_server.url, "connect_timeout_s": 10, "timeout_s": 10}
    with pytest.raises(ToolLoadError) as caught:  # no headers: rejected at replica start
        Toolbox.build([], [base])
    assert str(caught.value).startswith("rollout.mcp_servers[0] (secure): cannot connect: ")
    headers = {"Authorization": "Bearer ${FORAGE_MCP_TEST_TOKEN}", "X-Tenant": "acme"}
    monkeypatch.setenv("FORAGE_MCP_TEST_TOKEN", "wrong")
    with pytest.raises(ToolLoadError, match="cannot connect"):
        Toolbox.build([], [{**base, "headers": headers}])
    monkeypatch.setenv("FORAGE_MCP_TEST_TOKEN", TOKEN)
    box = Toolbox.build([], [{**base, "headers": headers}])
    try:
        assert box.names == ["add", "lookup", "slow", "die"]
        box.runner.submit("sum", ToolCall("add", {"a": 2, "b": 3}))
        assert drain(box.runner)["sum"].text == "5"
        assert TOKEN not in repr(box.hub.connections)
    finally:
        box.close()
    assert TOKEN not in caplog.text  # never logged, at any level


def test_header_variables_must_be_set_and_headers_are_checked(monkeypatch):
    monkeypatch.delenv("FORAGE_MCP_UNSET_TOKEN", raising=False)
    server = {"name": "secure", "url": "http://127.0.0.1:9/mcp",
              "headers": {"Authorization": "Bearer ${FORAGE_MCP_UNSET_TOKEN}"}}
    with pytest.raises(ToolLoadError, match=r"^rollout.mcp_servers\[0\] \(secure\): header\(s\) "
                                            r"Authorization need the environment variable\(s\) "
                                            r"FORAGE_MCP_UNSET_TOKEN, which are not set$"):
        Toolbox.build([], [server])
    for headers, message in [
        ({"Bad Name": "x"}, "not a valid HTTP header name"),
        ({"Authorization": "Bearer ${1x}"}, "does not start a reference"),
        ({"Authorization": "a\nb"}, "line break"),
    ]:
        with pytest.raises(ToolLoadError, match=message):
            Toolbox.build([], [{**server, "headers": headers}])
    with pytest.raises(ToolLoadError, match="headers are sent to url servers only"):
        Toolbox.build([], [{"name": "local", "command": sys.executable, "args": [SERVER],
                            "headers": {"Authorization": "x"}}])
