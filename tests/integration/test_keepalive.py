"""A real worker's slow prefill (issue 47, "slow machines lose no work": clients are kept waiting, not made to retry):
a streamed request that waits many keep-alives for its first token gets, all along, events its API defines and its
clients count as activity (Qwen Code counts chat chunks, Codex Responses events, Claude Code Anthropic's pings;
none counts an SSE comment), the comments beside them say it prefills (never that it waits for memory), and the
official clients read the whole stream, with the text of the same request answered whole.

The worker runs with the slow-steps fault (every engine step 0.4 s) and prefills 16 tokens a step, so a prompt of
~150 tokens takes ~10 steps; keep-alives come every 0.25 s. Each API's prompt is its own, so none is prefilled from
another's cache. The bytes are read as the client reads them (a transport that keeps them, with when they came)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from tests.conftest import Daemon, start_daemon

KEEPALIVE_S = 0.25
TOKENS = 4  # each a slow step too
LONG = "a long prompt that takes many prefill steps " * 5


@pytest.fixture(scope="module")
def slow(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("keepalive")
    config = root / "slow.toml"
    config.write_text(f"""
[server]
prefill_step_size = 16
sse_keepalive_s = {KEEPALIVE_S}

[models.slow]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "slow-steps"]
""")
    d = start_daemon(root / "state", "--config", str(config))
    try:
        assert httpx.post(f"{d.url}/api/models/slow/load", timeout=60).status_code == 200  # loaded: only the prefill waits
        yield d
    finally:
        d.stop()


def keeping(http: Any) -> Any:
    """A transport of the HTTP package `http` (the anthropic SDK's is httpx2) that passes each response's bytes on as
    they come and keeps them, each with when it came."""
    class Kept(http.SyncByteStream):
        def __init__(self, inner: Any, came: list[tuple[float, bytes]]) -> None:
            self.inner, self.came = inner, came

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                self.came.append((time.monotonic(), chunk))
                yield chunk

        def close(self) -> None:
            self.inner.close()

    class Keeping(http.BaseTransport):
        def __init__(self) -> None:
            self.inner = http.HTTPTransport()
            self.came: list[tuple[float, bytes]] = []
            self.sent = 0.0

        def handle_request(self, request: Any) -> Any:
            self.sent = time.monotonic()
            response = self.inner.handle_request(request)
            return http.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                                 stream=Kept(response.stream, self.came), request=request)

        def close(self) -> None:
            self.inner.close()

        def blocks(self) -> list[tuple[float, str, Any]]:
            """The stream's SSE blocks as they came: (seconds since the request, "comment" or the event's name or
            "data", the comment's text or the data parsed)."""
            out, buffer = [], ""
            for at, chunk in self.came:
                buffer += chunk.decode()
                *done, buffer = buffer.split("\n\n")
                for block in filter(None, done):
                    if block.startswith(":"):
                        out.append((at - self.sent, "comment", block[1:].strip()))
                        continue
                    fields = dict(line.split(": ", 1) for line in block.split("\n"))
                    data = fields["data"]
                    out.append((at - self.sent, fields.get("event", "data"), data if data == "[DONE]" else json.loads(data)))
            return out

    return Keeping()


def waited(said: list[tuple[float, str, Any]], first_text: int) -> list[str]:
    """Asserts that the request waited many keep-alives for its first text (block `first_text`), that events came all
    along (no gap a client's idle timeout of a few keep-alives would end the stream in), and what the comments said
    meanwhile: the event names before the first text."""
    ttft = said[first_text][0]
    assert ttft >= 6 * KEEPALIVE_S, f"the prefill took {ttft:.2f}s: too little to test keep-alives"
    events = [at for at, kind, _ in said if kind != "comment"]
    gaps = [b - a for a, b in zip([0.0, *events], events)]
    assert max(gaps) < ttft / 2, f"a gap of {max(gaps):.2f}s without an event, first token at {ttft:.2f}s"
    before = said[:first_text]
    comments = [text for _, kind, text in before if kind == "comment"]
    assert comments and all(c == "waiting for the first token of slow: prefilling" for c in comments), comments
    kinds = [kind for _, kind, _ in before if kind != "comment"]
    assert len(kinds) >= 4, kinds
    return kinds


def test_a_chat_stream_gets_chunks_while_the_worker_prefills(slow: Daemon) -> None:
    kept = keeping(httpx)
    client = openai.OpenAI(base_url=slow.v1, api_key="x", max_retries=0, http_client=httpx.Client(transport=kept, timeout=120))
    messages = [{"role": "user", "content": "chat " + LONG}]
    chunks = list(client.chat.completions.create(model="slow", messages=messages, max_tokens=TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    said = kept.blocks()
    first_text = next(i for i, (_, kind, data) in enumerate(said)
                      if kind == "data" and data != "[DONE]" and data["choices"] and data["choices"][0]["delta"].get("content"))
    assert set(waited(said, first_text)) == {"data"}
    first = next(data for _, kind, data in said if kind == "data")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the role first, as OpenAI's
    assert sum("role" in data["choices"][0]["delta"] for _, kind, data in said
               if kind == "data" and data != "[DONE]" and data["choices"]) == 1

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="slow", messages=messages, max_tokens=TOKENS, temperature=0)
    assert text and text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id}


def test_a_completion_stream_gets_empty_chunks_while_the_worker_prefills(slow: Daemon) -> None:
    kept = keeping(httpx)
    client = openai.OpenAI(base_url=slow.v1, api_key="x", max_retries=0, http_client=httpx.Client(transport=kept, timeout=120))
    prompt = "legacy " + LONG
    got = list(client.completions.create(model="slow", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True))
    said = kept.blocks()
    first_text = next(i for i, (_, kind, data) in enumerate(said)
                      if kind == "data" and data != "[DONE]" and data["choices"][0]["text"])
    assert set(waited(said, first_text)) == {"data"}
    whole = client.completions.create(model="slow", prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert "".join(c.choices[0].text for c in got if c.choices) == whole.choices[0].text


def test_a_responses_stream_gets_response_in_progress_while_the_worker_prefills(slow: Daemon) -> None:
    kept = keeping(httpx)
    client = openai.OpenAI(base_url=slow.v1, api_key="x", max_retries=0, http_client=httpx.Client(transport=kept, timeout=120))
    prompt = "responses " + LONG
    events = list(client.responses.create(model="slow", input=prompt, max_output_tokens=TOKENS, temperature=0,
                                          stream=True))
    said = kept.blocks()
    first_text = next(i for i, (_, kind, _) in enumerate(said) if kind == "response.output_text.delta")
    kinds = waited(said, first_text)
    assert kinds[0] == "response.created" and kinds.count("response.in_progress") >= 4
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(model="slow", input=prompt, max_output_tokens=TOKENS, temperature=0)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == whole.output_text and events[-1].response.output_text == text


def test_a_messages_stream_gets_pings_while_the_worker_prefills(slow: Daemon) -> None:
    kept = keeping(httpx2)
    client = anthropic.Anthropic(base_url=slow.url, api_key="x", max_retries=0,
                                 http_client=httpx2.Client(transport=kept, timeout=120))
    messages = [{"role": "user", "content": "messages " + LONG}]
    greedy = {"temperature": 0}  # this SDK takes no temperature argument
    with client.messages.stream(model="slow", max_tokens=TOKENS, messages=messages, extra_body=greedy) as stream:
        text = stream.get_final_text()
    said = kept.blocks()
    first_text = next(i for i, (_, kind, _) in enumerate(said) if kind == "content_block_delta")
    kinds = waited(said, first_text)
    assert kinds[0] == "message_start" and kinds.count("ping") >= 4
    whole = client.messages.create(model="slow", max_tokens=TOKENS, messages=messages, extra_body=greedy)
    assert text and text == whole.content[0].text
