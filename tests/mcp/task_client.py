"""MCP tasks (2025-11-25) against `toolfleet mcp serve`, driven by the
official Python SDK's client session. The SDK has no typed tasks API
(its methods table leaves tasks/* out), so the requests go through the
session's `send_request` and every answer is checked against the SDK's
own 2025-11-25 wire models (`mcp_types._v2025_11_25`). Prints what it saw
as one JSON object.

Usage:
  task_client.py TARGET owner QUICK SLOW MISMATCH [hold]
      calls QUICK typed and as a task (polled, its result fetched;
      another's result waited for; one asked with ttl 0), SLOW as a task it
      cancels once it runs, and SLOW again as a task it leaves running;
      MISMATCH (whose data breaks its outputSchema) typed and as a task;
      lists the tasks. With `hold`: prints what it saw, waits for a line on
      stdin, then (same session) reads the task left running and cancels
      it, and prints that too.
  task_client.py TARGET intruder ID...     tries tasks/get, tasks/result and
      tasks/cancel on each ID, and lists its own tasks

An error is shown as "[code] message".

TARGET is the `toolfleet` binary (stdio; the tenant from TOOLFLEET_TENANT)
or an http://…/mcp URL."""

import json
import os
import sys
import time
from typing import Any

import anyio
import mcp.types as types
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import _v2025_11_25 as wire
from pydantic import TypeAdapter


class Raw(types.Request[dict[str, Any] | None, str]):
    """A request the SDK has no type for."""


ANY = TypeAdapter(dict[str, Any])


async def raw(session: ClientSession, method: str, params: dict | None = None) -> dict:
    return await session.send_request(Raw(method=method, params=params), ANY)


async def refused(session: ClientSession, method: str, params: dict) -> str:
    """The error a request is refused with (or "answered")."""
    try:
        await raw(session, method, params)
        return "answered"
    except Exception as e:  # the SDK raises the server's JSON-RPC error
        return f"[{getattr(e, 'code', '?')}] {e}"


async def unchecked(session: ClientSession, method: str, params: dict) -> dict:
    """A request through the session's own dispatcher, its answer left
    unchecked: the SDK checks every `tools/call` answer against
    CallToolResult, and a task-augmented call answers CreateTaskResult."""
    data = {"method": method, "params": params}
    opts: dict = {}
    session._stamp(data, opts)
    return await session._dispatcher.send_raw_request(method, params, opts)


async def start(session: ClientSession, tool: str, arguments: dict, ttl: int = 600000) -> dict:
    params = {"name": tool, "arguments": arguments, "task": {"ttl": ttl}}
    created = await unchecked(session, "tools/call", params)
    return wire.CreateTaskResult.model_validate(created).task.model_dump(mode="json", by_alias=True)


async def get(session: ClientSession, task_id: str) -> dict:
    got = await raw(session, "tasks/get", {"taskId": task_id})
    return wire.GetTaskResult.model_validate(got).model_dump(mode="json", by_alias=True, exclude_none=True)


async def until_ended(session: ClientSession, task_id: str) -> list:
    """The statuses tasks/get reported, polled at the pollInterval."""
    seen, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        task = await get(session, task_id)
        seen.append(task["status"])
        if task["status"] != "working":
            return seen
        await anyio.sleep(task.get("pollInterval", 500) / 1000)
    return seen


async def until_in_flight(session: ClientSession, task_id: str) -> dict:
    """Polls task TASK_ID until its status message is the slow tool's
    progress (it is running): the task then."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        task = await get(session, task_id)
        if task.get("statusMessage") == "stalling until cancelled":
            return task
        await anyio.sleep(0.05)
    return task


async def mismatch(session: ClientSession, tool: str) -> dict:
    """MISMATCH typed (the SDK would raise on structured content that breaks
    the schema: a tool error has none) and as a task."""
    typed = await session.call_tool(tool, {})
    task = await start(session, tool, {})
    statuses = await until_ended(session, task["taskId"])
    result = await raw(session, "tasks/result", {"taskId": task["taskId"]})
    return {
        "typed": typed.model_dump(mode="json", by_alias=True, exclude_none=True),
        "statuses": statuses,
        "result": wire.CallToolResult.model_validate(result).model_dump(mode="json", by_alias=True, exclude_none=True),
    }


async def tiny_ttl(session: ClientSession, quick: str) -> dict:
    """QUICK as a task asked to be kept 0 ms: the ttl granted, and it ends."""
    task = await start(session, quick, {"utcOffset": "+02:00"}, ttl=0)
    statuses = await until_ended(session, task["taskId"])
    result = await raw(session, "tasks/result", {"taskId": task["taskId"]})
    return {"ttl": task["ttl"], "statuses": statuses, "result": result}


async def owner(session: ClientSession, quick: str, slow: str, bad: str) -> dict:
    init_caps = session.server_capabilities
    listed = await raw(session, "tools/list", {})
    tools = {t["name"]: t for t in listed["tools"]}
    typed = await session.call_tool(quick, {"utcOffset": "+01:00"})  # the SDK checks the output schema

    # A quick task: working or done at once, then completed; its result.
    task = await start(session, quick, {"utcOffset": "+01:00"})
    statuses = await until_ended(session, task["taskId"])
    result = await raw(session, "tasks/result", {"taskId": task["taskId"]})
    result = wire.CallToolResult.model_validate(result).model_dump(mode="json", by_alias=True, exclude_none=True)

    # tasks/result of a task still working waits for its end.
    waited = await start(session, quick, {"utcOffset": "-03:00"})
    waited_result = await raw(session, "tasks/result", {"taskId": waited["taskId"]})

    # A slow task, cancelled while it runs; a second one left running.
    cancelled = await start(session, slow, {})
    working = await until_in_flight(session, cancelled["taskId"])
    after_cancel = wire.CancelTaskResult.model_validate(
        await raw(session, "tasks/cancel", {"taskId": cancelled["taskId"]})
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    kept = await start(session, slow, {})

    listed_tasks = wire.ListTasksResult.model_validate(await raw(session, "tasks/list", {}))
    return {
        "mismatch": await mismatch(session, bad),
        "tinyTtl": await tiny_ttl(session, quick),
        "capabilities": init_caps.model_dump(mode="json", by_alias=True, exclude_none=True)
        if init_caps else None,
        "outputSchema": tools[quick].get("outputSchema"),
        "execution": tools[quick].get("execution"),
        "typedStructured": typed.structured_content,
        "task": task,
        "statuses": statuses,
        "result": result,
        "waitedResult": waited_result,
        "slowWorking": working,
        "cancelled": after_cancel,
        "cancelledAfter": await get(session, cancelled["taskId"]),
        "cancelledResult": await refused(session, "tasks/result", {"taskId": cancelled["taskId"]}),
        "cancelAgain": await refused(session, "tasks/cancel", {"taskId": cancelled["taskId"]}),
        "unknown": await refused(session, "tasks/get", {"taskId": "inv-nonexistent"}),
        "kept": kept["taskId"],
        "listed": [t.task_id for t in listed_tasks.tasks],
        "badCursor": await refused(session, "tasks/list", {"cursor": "nonsense"}),
    }


async def intruder(session: ClientSession, ids: list) -> dict:
    tries = {}
    for task_id in ids:
        tries[task_id] = {
            method: await refused(session, method, {"taskId": task_id})
            for method in ("tasks/get", "tasks/result", "tasks/cancel")
        }
    listed = wire.ListTasksResult.model_validate(await raw(session, "tasks/list", {}))
    return {"tries": tries, "listed": [t.task_id for t in listed.tasks]}


async def finish(session: ClientSession, task_id: str) -> dict:
    before = await get(session, task_id)
    await raw(session, "tasks/cancel", {"taskId": task_id})
    return {"before": before, "after": await get(session, task_id)}


async def owner_holding(session: ClientSession, rest: list) -> None:
    seen = await owner(session, rest[0], rest[1], rest[2])
    print(json.dumps(seen), flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    print(json.dumps(await finish(session, seen["kept"])), flush=True)


async def main() -> None:
    target, scenario, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if target.startswith("http"):
        transport = streamable_http_client(target)
    else:
        params = StdioServerParameters(command=target, args=["mcp", "serve"], env=dict(os.environ))
        transport = stdio_client(params)
    async with transport as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            if scenario == "owner" and rest[3:] == ["hold"]:
                await owner_holding(session, rest)
                return
            if scenario == "owner":
                seen = await owner(session, rest[0], rest[1], rest[2])
            else:
                seen = await intruder(session, rest)
    print(json.dumps(seen))


anyio.run(main)
