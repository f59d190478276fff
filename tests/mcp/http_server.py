"""A small MCP server on the official Python SDK serving streamable HTTP,
for toolfleet's tests: `http_server.py PORT HELD NAME` serves
http://127.0.0.1:PORT/mcp with a tool that answers with text naming this
run of the server (NAME: a test tells a server started again from the
first), and one that creates the file HELD and then never answers (a test
knows the call is in flight before it kills the server)."""

import sys

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("tides")
port, held, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]


@server.tool()
def tide(harbour: str) -> str:
    """The next high water at a harbour."""
    return f"{harbour}: high water at 06:12 (the {name} server)"


@server.tool()
async def hold() -> str:
    """Never answers: the call stays in flight until the server dies."""
    open(held, "w").close()
    await anyio.sleep_forever()
    return "unreachable"


if __name__ == "__main__":
    print(f"tides MCP server ({name}) starting on port {port}", file=sys.stderr)
    server.run("streamable-http", host="127.0.0.1", port=port)
