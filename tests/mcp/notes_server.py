"""A small MCP server on the official Python SDK, for toolfleet's tests:
stdio, three tools — one that answers with text and a resource link, one
whose input schema does not compile, and one that kills its own process
mid-call (the worker must start it again)."""

import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.types import ResourceLink, TextContent

server = MCPServer("notes")


@server.tool()
def lookup(term: str) -> list:
    """Look up a term in the lighthouse keeper's notes."""
    return [
        TextContent(type="text", text=f"{term}: keepers wound the lamp every four hours"),
        ResourceLink(
            type="resource_link",
            uri="https://example.com/notes/lamp",
            name="lamp",
            title="The lamp log",
        ),
    ]


@server.tool()
def crash() -> str:
    """Stops the server in the middle of the call."""
    if os.environ.get("NOTES_CRASH_ONCE") and not os.path.exists(os.environ["NOTES_CRASH_ONCE"]):
        open(os.environ["NOTES_CRASH_ONCE"], "w").close()
        os._exit(3)
    return "survived"


if __name__ == "__main__":
    print("notes MCP server starting", file=sys.stderr)
    server.run()
