"""A toolfleet client in Python, written only from docs/clients.md
("Clients: submitting chat jobs from any language") and schemas/: what a
platform team's backend in another language does. Run by tests/clients.rs
against a real fleet:

    python3 tests/clients/python_client.py NATS_URL TENANT

It asks one question and follows its events to the answer, cancels a slow
question, reads a finished invocation's answer back from the events stream,
and prints one JSON line with what it saw. Any deviation from the contract
raises (exit status 1).
"""

import asyncio
import json
import sys
import uuid

import nats

PREFIX = "toolfleet"
TERMINAL = ("completed", "error")


def submit_subject(tenant):
    return f"{PREFIX}.chat.submit.{tenant}"


def events_subject(tenant, invocation_id):
    return f"{PREFIX}.chat.events.{tenant}.{invocation_id}"


def cancel_subject(tenant, invocation_id):
    return f"{PREFIX}.chat.cancel.{tenant}.{invocation_id}"


async def submit(js, tenant, invocation_id, question):
    body = {
        "invocationId": invocation_id,
        "messages": [{"role": "user", "content": question}],
    }
    # No Nats-Msg-Id: the chat stream's duplicate window is shared by every
    # tenant (docs/clients.md); the fleet runs an invocation id once.
    ack = await js.publish(submit_subject(tenant), json.dumps(body).encode())
    return ack


async def follow(sub, first=None):
    """Events up to the terminal one; checks `seq` counts from 0."""
    events = [first] if first else []
    while not events or events[-1]["type"] not in TERMINAL:
        event = json.loads((await sub.next_msg(timeout=60)).data)
        if event["seq"] != len(events):
            raise AssertionError(f"seq {event['seq']}, expected {len(events)}: {event}")
        events.append(event)
    return events


async def main(url, tenant):
    nc = await nats.connect(url)
    js = nc.jetstream()
    seen = {}

    # 1. Ask, and follow the events to the answer.
    invocation_id = f"py-{uuid.uuid4().hex}"
    sub = await nc.subscribe(events_subject(tenant, invocation_id))
    await nc.flush()
    ack = await submit(js, tenant, invocation_id, "How do lighthouses warn ships?")
    if ack.duplicate:
        raise AssertionError("a first submit was taken for a duplicate")
    # A retried submit (its ack lost, say) is stored again but not run
    # twice: the events below are one run's (`follow` checks `seq`).
    await submit(js, tenant, invocation_id, "How do lighthouses warn ships?")
    events = await follow(sub)
    try:
        extra = await sub.next_msg(timeout=1)
        raise AssertionError(f"a retried submit ran again: {extra.data!r}")
    except nats.errors.TimeoutError:
        pass
    await sub.unsubscribe()
    done = events[-1]
    if done["type"] != "completed":
        raise AssertionError(f"not completed: {done}")
    if events[0]["type"] != "started":
        raise AssertionError(f"first event: {events[0]}")
    cited = [r["index"] for r in done["references"]]
    for index in cited:
        if f"[doc:{index}]" not in done["text"]:
            raise AssertionError(f"reference {index} is not cited in {done['text']!r}")
    seen["answer"] = {
        "types": [e["type"] for e in events],
        "text": done["text"],
        "references": cited,
    }

    # 2. Missed the answer? The events stream keeps it.
    reply = await nc.request(
        f"$JS.API.DIRECT.GET.{PREFIX.upper()}_EVENTS.{events_subject(tenant, invocation_id)}",
        b"",
        timeout=5,
    )
    stored = json.loads(reply.data)
    if stored != done:
        raise AssertionError(f"stored {stored} is not the answer {done}")
    missing = await nc.request(
        f"$JS.API.DIRECT.GET.{PREFIX.upper()}_EVENTS.{events_subject(tenant, 'py-never-asked')}",
        b"",
        timeout=5,
    )
    status = (missing.headers or {}).get("Status")
    if status != "404" or missing.data:
        raise AssertionError(f"an unknown invocation: status {status}, {missing.data!r}")
    seen["stored"] = stored["type"]

    # 3. Cancel a slow question while it runs.
    slow_id = f"py-{uuid.uuid4().hex}"
    sub = await nc.subscribe(events_subject(tenant, slow_id))
    await nc.flush()
    await submit(js, tenant, slow_id, "A slow question, please")
    first = json.loads((await sub.next_msg(timeout=30)).data)
    if first["type"] != "started":
        raise AssertionError(f"first event: {first}")
    await nc.publish(cancel_subject(tenant, slow_id), b"")
    await nc.flush()
    rest = await follow(sub, first)
    if rest[-1]["type"] != "error" or rest[-1]["code"] != "cancelled":
        raise AssertionError(f"not cancelled: {rest[-1]}")
    seen["cancelled"] = rest[-1]["code"]

    await nc.drain()
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
