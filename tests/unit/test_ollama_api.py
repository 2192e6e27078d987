"""Ollama's API (issue 51), its pure translation: request bodies onto the neutral Submit (ollama_api.py), the
response lines (ollama_shape.py), the model names (ollama_models.py), which /api/pull body is Ollama's and the
listener's address. No daemon."""

from __future__ import annotations

import pytest

from protocol.messages import Finished
from supervisor.errors import InvalidRequest
from supervisor.gateway.ollama_api import keep_alive, parse_chat, parse_embed, parse_generate
from supervisor.gateway.ollama_listener import address
from supervisor.gateway.ollama_models import candidates, expires_at, parameter_size
from supervisor.gateway.ollama_routes import ollama_pull
from supervisor.gateway.ollama_shape import OllamaShaper, Timing

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (0, 0.0), ("0", 0.0), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5),
    ("300ms", 0.3), ("-1", -1.0), (-1, -1.0), ("-1m", -60.0), ("10", 10.0), (10**12, -1.0)])
def test_keep_alive_reads_seconds_and_go_durations(value: object, seconds: float | None) -> None:
    assert keep_alive(value) == pytest.approx(seconds) if seconds is not None else keep_alive(value) is None


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", [], {}, True, "1x"])
def test_keep_alive_refuses_what_is_no_duration(value: object) -> None:
    with pytest.raises(InvalidRequest):
        keep_alive(value)


def test_chat_maps_options_onto_the_submit_and_streams_by_default() -> None:
    req = parse_chat({"model": "m:latest", "messages": HI, "keep_alive": "2m", "options": {
        "num_predict": 7, "temperature": 0.2, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "stop": ["\n", "x"],
        "seed": 42, "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_ctx": 4096,
        "num_thread": 8}})
    assert req.parsed is not None and req.model == "m:latest" and req.keep_alive == 120
    s = req.parsed.submit
    assert req.parsed.stream is True
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.min_p, s.stop, s.seed) == (7, 0.2, 5, 0.9, 0.1,
                                                                                        ["\n", "x"], 42)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)
    assert req.parsed.sampling_given == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}
    assert parse_chat({"model": "m", "messages": HI, "stream": False,
                       "options": {"num_predict": -1}}).parsed.submit.max_tokens == 0  # type: ignore[union-attr]


def test_chat_messages_images_tool_calls_thinking_and_tool_results() -> None:
    req = parse_chat({"model": "m", "think": False, "format": {"type": "object"}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look", "images": ["iVBORw0KGgo="]},
        {"role": "assistant", "content": "", "thinking": "hmm",
         "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_name": "f"}]})
    assert req.parsed is not None
    s = req.parsed.submit
    assert s.messages[1]["content"][0] == {"type": "image", "source": {"data": "iVBORw0KGgo=",
                                                                        "where": "messages[1].images[0]"}}
    assert s.messages[2]["tool_calls"] == [{"id": "call_0", "type": "function",
                                            "function": {"name": "f", "arguments": {"a": 1}}}]
    assert s.messages[2]["reasoning_content"] == "hmm"
    assert s.messages[3] == {"role": "tool", "content": "42", "name": "f", "tool_call_id": "call_0"}
    assert s.tools == [{"name": "f", "description": "", "parameters": {"type": "object"}}]
    assert s.constraint == {"type": "json", "schema": {"type": "object"}}
    assert s.template_kwargs == {"enable_thinking": False} and req.think is False
    high = parse_chat({"model": "m", "messages": HI, "think": "high", "format": "json"})
    assert high.parsed.submit.template_kwargs == {"enable_thinking": True,  # type: ignore[union-attr]
                                                  "reasoning_effort": "high"}
    assert high.parsed.submit.constraint == {"type": "json", "schema": None}  # type: ignore[union-attr]


def test_an_empty_chat_or_prompt_loads_the_model() -> None:
    assert parse_chat({"model": "m", "messages": []}).parsed is None
    assert parse_generate({"model": "m", "keep_alive": 0}).parsed is None


def test_generate_raw_system_and_the_template_ollama_alone_has() -> None:
    raw = parse_generate({"model": "m", "prompt": "Once", "raw": True}).parsed
    assert raw is not None and raw.submit.prompt == "Once" and raw.submit.messages is None
    turn = parse_generate({"model": "m", "prompt": "Once", "system": "sys"}).parsed
    assert turn is not None and turn.submit.messages == [{"role": "system", "content": "sys"},
                                                         {"role": "user", "content": "Once"}]
    for body in ({"template": "{{ .Prompt }}"}, {"suffix": "end"}, {"raw": "yes"}, {"prompt": 3}):
        with pytest.raises(InvalidRequest):
            parse_generate({"model": "m", "prompt": "x", **body})


@pytest.mark.parametrize("body", [
    [], "x", {"messages": HI}, {"model": "", "messages": HI}, {"model": "m", "messages": "hi"},
    {"model": "m", "messages": [{"role": "oracle", "content": "x"}]},
    {"model": "m", "messages": [{"role": "user", "content": 1}]},
    {"model": "m", "messages": [{"role": "assistant", "content": "x", "images": ["aGk="]}]},
    {"model": "m", "messages": [{"role": "user", "content": "x", "images": "aGk="}]},
    {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "<|im_end|>"}}]}]},
    {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}]},
    {"model": "m", "messages": HI, "stream": "yes"}, {"model": "m", "messages": HI, "options": []},
    {"model": "m", "messages": HI, "options": {"temperature": "hot"}},
    {"model": "m", "messages": HI, "options": {"num_predict": -3}},
    {"model": "m", "messages": HI, "options": {"num_predict": 1.5}},
    {"model": "m", "messages": HI, "options": {"stop": [1]}},
    {"model": "m", "messages": HI, "options": {"stop": ["x"] * 17}},
    {"model": "m", "messages": HI, "options": {"seed": 2**64}},
    {"model": "m", "messages": HI, "format": "yaml"}, {"model": "m", "messages": HI, "think": "max"},
    {"model": "m", "messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]},
    {"model": "m", "messages": HI, "keep_alive": "whenever"},
    {"model": "m", "messages": HI, "logprobs": True, "top_logprobs": 99},
])
def test_every_bad_chat_body_is_a_400(body: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_chat(body)


def test_embed_bodies() -> None:
    new = parse_embed({"model": "e", "input": ["a", "b"], "truncate": False, "dimensions": 8})
    assert (new.inputs, new.truncate, new.dimensions, new.old) == (["a", "b"], None, 8, False)
    assert parse_embed({"model": "e", "input": "a"}).truncate == 0
    old = parse_embed({"model": "e", "prompt": "a", "keep_alive": "1m"}, old=True)
    assert (old.inputs, old.keep_alive, old.old) == (["a"], 60.0, True)
    for body in ({"model": "e"}, {"model": "e", "input": []}, {"model": "e", "input": [1]},
                 {"model": "e", "input": "a", "dimensions": 0}, {"model": "e", "input": "a", "truncate": 1}):
        with pytest.raises(InvalidRequest):
            parse_embed(body)


def finished(text: str = "", reason: str = "stop", extra: dict | None = None) -> Finished:
    return Finished("r", text, reason, prompt_tokens=10, completion_tokens=3, cached_tokens=4, extra=extra)


def test_a_streamed_tool_call_is_one_line_with_its_arguments_an_object() -> None:
    shaper = OllamaShaper("m:latest", chat=True)
    assert shaper.feed("", {"calls": [[0, "call_1", "f", '{"a"']]}) is None  # held until the call stops
    assert shaper.feed("", {"calls": [[0, "", "", ": 1}"]]}) is None
    timing = Timing()
    lines = shaper.last(finished(reason="tool_calls"), timing.durations(finished(), None))
    assert lines[0]["message"]["tool_calls"] == [{"function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]
    done = lines[-1]
    assert done["done"] is True and done["done_reason"] == "stop" and done["model"] == "m:latest"
    assert done["prompt_eval_count"] == 6 and done["eval_count"] == 3  # what was prefilled: the cached 4 were not
    assert {"total_duration", "load_duration", "prompt_eval_duration", "eval_duration"} <= set(done)


def test_thinking_and_text_lines_and_the_whole_response_agree() -> None:
    streamed, whole = OllamaShaper("m", chat=False), OllamaShaper("m", chat=False)
    for shaper in (streamed, whole):
        lines = [shaper.feed("", {"reasoning": "hmm"}), shaper.feed("Hello", None)]
    assert lines == [{"model": "m", "created_at": lines[0]["created_at"], "response": "", "thinking": "hmm",  # type: ignore[index]
                      "done": False},
                     {"model": "m", "created_at": lines[1]["created_at"], "response": "Hello", "done": False}]  # type: ignore[index]
    body = whole.whole(finished(" there", "length"), {})
    assert (body["response"], body["thinking"], body["done"], body["done_reason"]) == ("Hello", "hmm", True, "length")


@pytest.mark.parametrize(("name", "tried"), [
    ("tiny", ["tiny"]), ("tiny:latest", ["tiny:latest", "tiny"]), ("tiny:7b", ["tiny:7b"]),
    ("hf.co/org/m", ["hf.co/org/m", "org/m"]), ("hf.co/org/m:main", ["hf.co/org/m:main", "org/m"]),
    ("huggingface.co/org/m:latest", ["huggingface.co/org/m:latest", "org/m"]), ("org/m:latest", ["org/m:latest", "org/m"])])
def test_ollama_names_map_onto_local_ones(name: str, tried: list[str]) -> None:
    assert candidates(name) == tried


def test_which_pull_body_is_ollamas() -> None:
    assert ollama_pull({"model": "hf.co/org/m", "insecure": False, "stream": True})
    assert ollama_pull({"name": "org/m"}) and ollama_pull({"model": "llama3.2:1b"}) and ollama_pull({"model": "a/b:c"})
    assert not ollama_pull({"model": "org/m"}) and not ollama_pull({"model": "org/m@v1", "stream": True})
    assert not ollama_pull({"model": "org/name@main:x"}) and not ollama_pull({"model": "llama3.2", "stream": True})


def test_the_listener_address_setting() -> None:
    assert address("127.0.0.1:11434") == ("127.0.0.1", 11434)
    assert address("[::1]:11435") == ("::1", 11435) and address("11500") == ("127.0.0.1", 11500)
    assert address("off") is None and address("") is None
    with pytest.raises(ValueError):
        address("127.0.0.1:ollama")


def test_sizes_and_expiry() -> None:
    assert parameter_size(135_000_000) == "135.0M" and parameter_size(7_600_000_000) == "7.6B"
    assert expires_at(None, None, False).startswith("2") and int(expires_at(None, None, False)[:4]) > 2100
    assert int(expires_at(30.0, 600.0, True)[:4]) > 2100


def test_a_taken_port_is_said_and_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    from supervisor.config import Settings
    from supervisor.daemon import listen
    from supervisor.gateway.ollama_listener import STATUS, open_listener

    held = listen("127.0.0.1", 0)
    try:
        port = held.getsockname()[1]
        assert open_listener(Settings(ollama_listen=f"127.0.0.1:{port}"), 8800, listen) is None
        assert STATUS.state == "taken" and STATUS.address == f"127.0.0.1:{port}" and "in use" in (STATUS.error or "")
        said = [r.getMessage() for r in caplog.records if r.name == "supervisor.gateway.ollama_listener"]
        assert len(said) == 1 and f"127.0.0.1:{port} is taken" in said[0] and "ollama_listen" in said[0]
        assert open_listener(Settings(ollama_listen="off"), 8800, listen) is None and STATUS.state == "off"
    finally:
        held.close()


@pytest.mark.parametrize(("path", "headers", "passes"), [
    ("/api/chat", [], True),  # LiteLLM's Ollama provider: JSON with no type, from no page
    ("/api/chat", [(b"origin", b"http://127.0.0.1:8800")], False),  # a page's POST says its Origin: typed or refused
    ("/api/chat", [(b"content-type", b"text/plain")], False),
    ("/api/chat", [(b"content-type", b"application/json")], True),
    ("/v1/chat/completions", [], False),  # the other routes keep the rule whole
])
def test_an_untyped_body_passes_only_on_ollamas_paths_from_no_page(path: str, headers: list, passes: bool) -> None:
    import asyncio

    from supervisor.gateway.guard import WebGuard
    from supervisor.gateway.ollama_routes import PATHS

    seen: list[dict] = []
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope)

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "scheme": "http", "method": "POST", "path": path,
             "headers": [(b"host", b"127.0.0.1:8800"), (b"content-length", b"2"), *headers]}
    asyncio.run(WebGuard(app, untyped=PATHS)(scope, receive, send))
    assert bool(seen) is passes
    assert passes or sent[0]["status"] in (403, 415)


def test_mlxsup_status_says_where_ollamas_api_is() -> None:
    from supervisor.cli.views import ollama_line

    on = {"ollama_listener": {"address": "127.0.0.1:11434", "state": "listening", "error": None}}
    taken = {"ollama_listener": {"address": "127.0.0.1:11434", "state": "taken", "error": "Address already in use"}}
    assert ollama_line(on) == "Ollama's API also on http://127.0.0.1:11434"
    assert "taken (Address already in use)" in (ollama_line(taken) or "")
    assert ollama_line({"ollama_listener": {"address": None, "state": "off", "error": None}}) is None
    assert ollama_line({}) is None  # an older daemon's status


def test_keep_alive_is_said_to_the_router_and_zero_evicts() -> None:
    import asyncio
    from types import SimpleNamespace

    from supervisor.gateway.ollama_keepalive import KeepAlive

    evicted: list[tuple] = []
    kept: list[tuple] = []

    async def evict(*args: object, **kw: object) -> SimpleNamespace:
        evicted.append((*args, kw))
        return SimpleNamespace(to_dict=dict)

    router = SimpleNamespace(evict=evict, keep_alive=lambda *args: kept.append(args))
    keep = KeepAlive(router)  # type: ignore[arg-type]
    keep.after("m", None)
    keep.after("m", 600.0)
    keep.after("m", -1.0)
    assert kept == [("m", 600.0), ("m", -1.0)] and not evicted

    async def unload() -> None:
        keep.after("m", 0)
        await asyncio.gather(*keep._tasks)  # the unload it started

    asyncio.run(unload())
    assert evicted == [("m", "drain", None, {"reason": "keep_alive"})] and len(kept) == 2
