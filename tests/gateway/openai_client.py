"""The official OpenAI Python client against toolfleet's gateway.

Usage: openai_client.py BASE_URL API_KEY QUESTION

Asks QUESTION through Chat Completions and Responses, streamed and not,
checks on the way that every citation annotation spans a `[k]` marker of
the text, and prints one JSON line: per API the text, the number of
citations and the total tokens; the models listed; the status codes of a
bad key and an unknown model (raised as the client's own error types).
"""

import json
import sys

import openai


def check_spans(text, spans):
    for start, end, url, title in spans:
        marker = text[start:end]
        assert marker.startswith("[") and marker.endswith("]"), (marker, start, end, text)
        assert marker[1:-1].isdigit(), marker
        assert url and title, (url, title)
    return len(spans)


def chat(client, question):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}]
    )
    message = r.choices[0].message
    spans = [
        (a.url_citation.start_index, a.url_citation.end_index, a.url_citation.url, a.url_citation.title)
        for a in (message.annotations or [])
    ]
    assert r.choices[0].finish_reason == "stop"
    return {
        "text": message.content,
        "citations": check_spans(message.content, spans),
        "total_tokens": r.usage.total_tokens,
    }


def chat_stream(client, question):
    text, spans, usage, finish = "", [], None, None
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text += delta.content
            # Not in the client's typed delta: kept as an extra field.
            for a in getattr(delta, "annotations", None) or []:
                c = a["url_citation"]
                spans.append((c["start_index"], c["end_index"], c["url"], c["title"]))
            if choice.finish_reason:
                finish = choice.finish_reason
    assert finish == "stop", finish
    return {"text": text, "citations": check_spans(text, spans), "total_tokens": usage.total_tokens}


def responses(client, question):
    r = client.responses.create(model="default", input=question, instructions="Be brief.")
    assert r.status == "completed", r.status
    part = r.output[0].content[0]
    spans = [(a.start_index, a.end_index, a.url, a.title) for a in part.annotations]
    assert part.text == r.output_text
    return {
        "text": r.output_text,
        "citations": check_spans(r.output_text, spans),
        "total_tokens": r.usage.total_tokens,
    }


def responses_stream(client, question):
    text, spans, final, kinds = "", [], None, []
    stream = client.responses.create(
        model="default",
        input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
        stream=True,
    )
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.output_text.annotation.added":
            a = event.annotation
            a = a if isinstance(a, dict) else a.model_dump()
            spans.append((a["start_index"], a["end_index"], a["url"], a["title"]))
        elif event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert final.output_text == text, (final.output_text, text)
    return {"text": text, "citations": check_spans(text, spans), "total_tokens": final.usage.total_tokens}


def errors(base_url, key):
    out = {}
    bad = openai.OpenAI(base_url=base_url, api_key="tf_" + "x" * 43, max_retries=0)
    try:
        bad.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])
    except openai.AuthenticationError as e:
        out["bad_key"] = e.status_code
    good = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    try:
        good.responses.create(model="no-such-model", input="hi")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e.code
        out["unknown_model"] = e.status_code
    return out


def main():
    base_url, key, question = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    seen = {
        "chat": chat(client, question),
        "chat_stream": chat_stream(client, question),
        "responses": responses(client, question),
        "responses_stream": responses_stream(client, question),
        "models": sorted(m.id for m in client.models.list()),
        "errors": errors(base_url, key),
    }
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
