"""A tiny MCP server for tests/rollout/test_mcp_tools.py, written with the SDK's MCPServer
(FastMCP's name since mcp 2): `add`, `lookup` over a small dict, `slow` and `die` (the
process exits mid-call, as a crashed server would).

    python tests/rollout/mcp_server.py            # stdio
    python tests/rollout/mcp_server.py http PORT  # streamable HTTP on 127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

FACTS = {"brixol": "Brixol was born in Corvale.", "tamra": "Tamra was born in Dunmore."}

app = MCPServer("forage-test")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def lookup(key: str) -> str:
    """Look a name up in the facts table."""
    return FACTS.get(key.strip().lower(), f"no fact about {key}")


@app.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer (for timeouts)."""
    time.sleep(seconds)
    return "done"


@app.tool()
def die() -> str:
    """Exit the server process without answering."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
