"""A small MCP server on the official Python SDK, for toolfleet's tests:
stdio: a tool that answers with text and a resource link, one (read-only)
that kills its own process mid-call once (the worker starts it again and
retries), one that writes and dies (not retried: it may have written),
and one that adds a tool and says the list changed."""

import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ResourceLink, TextContent, ToolAnnotations

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


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def crash() -> str:
    """Stops the server in the middle of the call (read-only: worth a retry)."""
    if os.environ.get("NOTES_CRASH_ONCE") and not os.path.exists(os.environ["NOTES_CRASH_ONCE"]):
        open(os.environ["NOTES_CRASH_ONCE"], "w").close()
        os._exit(3)
    return "survived"


@server.tool()
def write_and_die(text: str) -> str:
    """Appends to the notes, then stops the server before answering."""
    os._exit(4)


@server.tool()
async def learn(word: str, ctx: Context) -> str:
    """Teaches the server a new tool, recall, and says its tools changed."""

    def recall() -> str:
        """Recalls the word learned."""
        return f"learned: {word}"

    server.add_tool(recall, name="recall")
    await ctx.session.send_tool_list_changed()
    return "learned"


if __name__ == "__main__":
    print("notes MCP server starting", file=sys.stderr)
    server.run()
