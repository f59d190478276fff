"""A real MCP client (the official Python SDK) of `toolfleet mcp serve`:
lists the fleet's tools and calls one, printing what it saw as one JSON
object. Usage: fleet_client.py TOOLFLEET_BINARY TOOL ARGUMENTS_JSON"""

import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def main() -> None:
    binary, tool, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params = StdioServerParameters(command=binary, args=["mcp", "serve"], env=dict(os.environ))
    progress = []

    async def on_progress(done, total, message):
        progress.append(message)

    async with stdio_client(params) as (read, write):
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
