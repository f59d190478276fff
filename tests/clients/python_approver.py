"""An approver in Python, written only from docs/approvals.md ("Approvals:
a person's yes before a tool runs"), docs/clients.md (subjects, submitting,
the events) and schemas/ (chat_event, approval): a backend that asks, sees
a call wait for a person, and decides. Run by tests/clients.rs against a
real fleet whose default profile requires approval for the clock:

    python3 tests/clients/python_approver.py NATS_URL TENANT

It asks a question, reads the approval_requested event, sends a bad
approval (refused with a code), then a denial with a reason, follows the
events to the answer, and prints one JSON line with what it saw. Any
deviation from the contract raises (exit status 1).
"""

import asyncio
import json
import sys
import uuid

import nats

PREFIX = "toolfleet"


async def main(url, tenant):
    nc = await nats.connect(url)
    js = nc.jetstream()
    seen = {}
    invocation_id = f"py-{uuid.uuid4().hex}"
    sub = await nc.subscribe(f"{PREFIX}.chat.events.{tenant}.{invocation_id}")
    await nc.flush()
    body = {
        "invocationId": invocation_id,
        "messages": [{"role": "user", "content": "What does one clock say?"}],
    }
    await js.publish(
        f"{PREFIX}.chat.submit.{tenant}",
        json.dumps(body).encode(),
        headers={"Nats-Msg-Id": invocation_id},
    )

    events = []

    async def next_event():
        event = json.loads((await sub.next_msg(timeout=60)).data)
        if event["seq"] != len(events):
            raise AssertionError(f"seq {event['seq']}, expected {len(events)}: {event}")
        events.append(event)
        return event

    while True:
        event = await next_event()
        if event["type"] in ("completed", "error"):
            raise AssertionError(f"ended before asking for approval: {event}")
        if event["type"] == "approval_requested":
            break
    for key in ("callId", "tool", "arguments", "expiresAtMs", "subject"):
        if key not in event:
            raise AssertionError(f"approval_requested lacks {key}: {event}")
    expected = f"{PREFIX}.chat.approve.{tenant}.{invocation_id}"
    if event["subject"] != expected:
        raise AssertionError(f"subject {event['subject']}, expected {expected}")
    seen["tool"] = event["tool"]

    # A decision that is not one is refused with a code; nothing changes.
    reply = json.loads(
        (await nc.request(event["subject"], json.dumps({"callId": event["callId"], "decision": "maybe"}).encode(), timeout=10)).data
    )
    if reply.get("ok") is not False or reply.get("code") != "malformed_approval":
        raise AssertionError(f"a bad decision was not refused: {reply}")
    seen["refused"] = reply["code"]

    # The denial, with the reason the model will read.
    denial = {"callId": event["callId"], "decision": "deny", "reason": "clocks are off limits", "approver": "py"}
    reply = json.loads((await nc.request(event["subject"], json.dumps(denial).encode(), timeout=10)).data)
    if reply != {"ok": True}:
        raise AssertionError(f"the denial was not recorded: {reply}")

    while events[-1]["type"] not in ("completed", "error"):
        await next_event()
    done = events[-1]
    if done["type"] != "completed":
        raise AssertionError(f"not completed: {done}")
    resolved = [e for e in events if e["type"] == "approval_resolved"]
    results = [e for e in events if e["type"] == "tool_result"]
    seen["resolved"] = [e["decision"] for e in resolved]
    seen["results"] = [[e["status"], e.get("errorCode")] for e in results]
    seen["text"] = done["text"]
    print(json.dumps(seen))
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
