"""A real MCP client (the official Python SDK) of `toolfleet mcp serve`:
lists the fleet's tools and calls one, printing what it saw as one JSON
object. Usage: fleet_client.py TARGET TOOL ARGUMENTS_JSON, where TARGET is
the `toolfleet` binary (stdio) or the server's http://…/mcp URL
(streamable HTTP)."""

import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client


async def main() -> None:
    target, tool, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    progress = []

    async def on_progress(done, total, message):
        progress.append(message)

    if target.startswith("http"):
        transport = streamable_http_client(target)
    else:
        params = StdioServerParameters(command=target, args=["mcp", "serve"], env=dict(os.environ))
        transport = stdio_client(params)
    async with transport as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await session.initialize()
            listed = await session.list_tools()
            result = await session.call_tool(tool, arguments, progress_callback=on_progress)
            try:
                await session.call_tool("no_such_tool", {})
                missing = "answered"
            except Exception as e:  # the SDK raises the server's JSON-RPC error
                missing = str(e)
    print(json.dumps({
        "tools": sorted(t.name for t in listed.tools),
        "schemas": {t.name: t.input_schema for t in listed.tools},
        "isError": result.is_error,
        "content": [c.model_dump(mode="json", exclude_none=True) for c in result.content],
        "structured": result.structured_content,
        "progress": progress,
        "missing": missing,
    }))


asyncio.run(main())
