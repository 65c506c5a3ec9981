"""A tiny MCP server for tests/rollout/test_mcp_tools.py, written with the SDK's MCPServer
(FastMCP's name since mcp 2): `add`, `lookup` over a small dict, `slow` and `die` (the
process exits mid-call, as a crashed server would).

    python tests/rollout/mcp_server.py            # stdio
    python tests/rollout/mcp_server.py http PORT  # streamable HTTP on 127.0.0.1:PORT/mcp

With FORAGE_TEST_MCP_TOKEN set, the HTTP server answers 401 to every request that lacks
`Authorization: Bearer <that token>` (and, with FORAGE_TEST_MCP_TENANT set, the header
`X-Tenant: <that value>` as well), as a server behind bearer auth does.
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


def require_headers(inner, required: dict[bytes, bytes]):
    """An ASGI middleware: HTTP requests without every `required` header get 401."""
    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if any(headers.get(name) != value for name, value in required.items()):
                body = b'{"error": "unauthorized"}'
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await inner(scope, receive, send)

    return guarded


def serve_http(port: int) -> None:
    token = os.environ.get("FORAGE_TEST_MCP_TOKEN")
    if not token:
        app.run("streamable-http", host="127.0.0.1", port=port)
        return
    import uvicorn

    required = {b"authorization": f"Bearer {token}".encode()}
    tenant = os.environ.get("FORAGE_TEST_MCP_TENANT")
    if tenant:
        required[b"x-tenant"] = tenant.encode()
    guarded = require_headers(app.streamable_http_app(), required)
    uvicorn.run(guarded, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        serve_http(int(sys.argv[2]))
    else:
        app.run()
