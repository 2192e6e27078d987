"""Images through the three APIs (issue 29): the unmodified `openai` SDK (chat `image_url`, Responses
`input_image`) and `anthropic` SDK (`image` blocks) against one daemon serving a tiny Qwen3-VL, a tiny Gemma 3
and a tiny text model. Greedy output equals mlx-vlm's own generate for the same model, image and prompt
(test_vision.py's reference, in this process), for both families, alone and in one batch with text-only
requests; an image request streams, decodes under a JSON schema and makes a forced tool call as a text request
does (Gemma 3's through the worker's tool fallback), and a Gemma sibling session picks up its elder's head; every bad image is a 400 in the API's own error body, said by the gateway before any worker is asked, and
the vision worker neither restarts nor grows.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

import anthropic
import openai

from tests.conftest import Daemon, start_daemon, wait_for
from tests.integration.test_vision import MAX_TOKENS, QUESTION, picture, png, reference

PROMPT = QUESTION[0]["content"][1]["text"]
MAX_IMAGES = 2  # the daemon's image_max_count, so "too many" is three
FAMILIES = {"vl": "qwen3_vl", "gemma": "gemma3_vl"}
BLOCK = 16  # the prompt caches' block  # model id in the daemon's folder -> make-model's arch


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model import make_model

    root = tmp_path_factory.mktemp("vision-models")
    for name, arch in FAMILIES.items():
        make_model(root / name, "tiny", arch=arch)
    make_model(root / "text", "tiny")
    return root


@pytest.fixture(scope="module")
def daemon(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    state = tmp_path_factory.mktemp("vision-state")
    config = state / "config.toml"
    # blocks of 16: Gemma's caches keep a tiny prompt's image at a snapshot inside it (the test below says why)
    config.write_text(f"[server]\nimage_max_count = {MAX_IMAGES}\n\n[cache]\nblock_tokens = {BLOCK}\n")
    d = start_daemon(state, "--model-dir", str(models), "--config", str(config))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def mlx_vlm_said(models: Path) -> dict[str, tuple[str, list[float]]]:
    """Per family, mlx-vlm's greedy answer for picture(0) and QUESTION: its text (the answer's leading blank, which
    the worker's output parser drops, left out) and each token's logprob. The engine in this process holds the same
    model, processor and tokenizer the worker loads."""
    from worker.mlx_engine.vision import vision_engine

    said = {}
    for name in FAMILIES:
        engine = vision_engine(models / name, max_batch_size=1, probe=False)
        try:
            tokens, logprobs = reference(engine, picture(0))
            text = engine.tokenizer.decode(tokens).lstrip()
        finally:
            engine.settle()
        assert len(tokens) == MAX_TOKENS and text, text  # a plain answer: no markup the parsers would move
        said[name] = text, logprobs
    return said


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    """The vision model's id in the daemon: each family's test runs through the same daemon."""
    return request.param


@pytest.fixture
def mlx_vlm_says(mlx_vlm_said: dict[str, tuple[str, list[float]]], family: str) -> tuple[str, list[float]]:
    return mlx_vlm_said[family]


@pytest.fixture
def expected(mlx_vlm_says: tuple[str, list[float]]) -> str:
    return mlx_vlm_says[0]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PICTURE = png(picture(0))


def chat_body(*images: str, model: str = "vl") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]}


def anthropic_body(*images: tuple[str, bytes], model: str = "vl") -> dict:
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": media, "data": base64.b64encode(data).decode()}}
              for media, data in images]
    return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": PROMPT}]}]}


def test_openai_chat_with_an_image_url_answers_as_mlx_vlm(daemon: Daemon, family: str,
                                                         mlx_vlm_says: tuple[str, list[float]]) -> None:
    """Each token's logprob too: text can agree by luck on a random model (it repeats a word), logprobs only if
    the worker read the same pixels at the same positions."""
    expected, logprobs = mlx_vlm_says
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(**chat_body(data_url(PICTURE), model=family), logprobs=True)
    assert resp.choices[0].message.content == expected
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
    # the image's prefix is computed at submit, outside the batch: prefilled, never reported as read from a cache
    details = resp.usage.prompt_tokens_details
    assert details is None or not details.cached_tokens
    assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content is not None
    assert np.allclose([t.logprob for t in resp.choices[0].logprobs.content], logprobs, atol=1e-4)
    stream = client.chat.completions.create(**chat_body(data_url(PICTURE), model=family), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def cached_tokens(resp: Any) -> int:
    details = resp.usage.prompt_tokens_details
    return details.cached_tokens or 0 if details is not None else 0


def test_a_second_turn_with_the_same_image_reports_cached_tokens_with_the_same_answer(daemon: Daemon) -> None:
    """The worker's prompt caches know an image by its pixels: the same image in the next turn is a hit through it
    (usage says so), answering as the turn computed whole (caches cleared) does; a different image is a miss."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    seen = data_url(png(picture(5)))
    first = client.chat.completions.create(**chat_body(seen))

    def second(url: str) -> Any:
        body = chat_body(url)
        body["messages"] += [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "And now?"}]
        return client.chat.completions.create(**body, logprobs=True)

    hit = second(seen)
    for tier in ("hot", "ssd"):
        httpx.post(f"{daemon.url}/api/{tier}-cache/clear", json={"model": "vl"}, timeout=60).raise_for_status()
    whole = second(seen)
    other = second(data_url(png(picture(6))))
    assert first.usage is not None and cached_tokens(whole) == 0
    assert cached_tokens(hit) >= first.usage.prompt_tokens, (cached_tokens(hit), first.usage)  # the image's, and on
    assert cached_tokens(other) < cached_tokens(hit) - 4  # at most the text before the image (tiny: 4 image tokens)
    assert hit.choices[0].message.content == whole.choices[0].message.content
    got, want = (r.choices[0].logprobs.content for r in (hit, whole))
    assert got is not None and want is not None
    assert np.allclose([t.logprob for t in got], [t.logprob for t in want], atol=1e-4)



def test_a_gemma_image_at_the_prompts_end_is_cached_through_a_snapshot_inside_it(daemon: Daemon) -> None:
    """Gemma 3's sliding layers are kept only at snapshots (block boundaries the prefill stops at). A prompt that
    ends a few tokens after its image (61 tokens, the image's 46-50) has its last boundary (48) inside the image
    prefix, which the worker prefills itself: it stops there and keeps the prefix, so the next turn is a hit into
    the image, answering as the turn computed whole does. Without that stop, nothing of the first turn is kept."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    seen = {"type": "image_url", "image_url": {"url": data_url(png(picture(7)))}}
    turn: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "Look closely at the following picture, then say what it shows:"}, seen]}]
    first = client.chat.completions.create(model="gemma", messages=turn, max_tokens=MAX_TOKENS, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens == 61  # the layout the docstring describes

    def second() -> Any:
        return client.chat.completions.create(model="gemma", max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                              messages=[*turn, {"role": "assistant", "content": "It is noise."},
                                                        {"role": "user", "content": "And now?"}])

    hit = second()
    for tier in ("hot", "ssd"):
        httpx.post(f"{daemon.url}/api/{tier}-cache/clear", json={"model": "gemma"}, timeout=60).raise_for_status()
    whole = second()
    assert cached_tokens(whole) == 0
    assert 0 < cached_tokens(hit) < first.usage.prompt_tokens, (cached_tokens(hit), first.usage)
    assert hit.choices[0].message.content == whole.choices[0].message.content
    got, want = (r.choices[0].logprobs.content for r in (hit, whole))
    assert got is not None and want is not None
    assert np.allclose([t.logprob for t in got], [t.logprob for t in want], atol=1e-4)

def test_openai_responses_with_an_input_image_answers_as_mlx_vlm(daemon: Daemon, family: str, expected: str) -> None:
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    turn: list[Any] = [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PICTURE), "detail": "auto"}, {"type": "input_text", "text": PROMPT}]}]
    resp = client.responses.create(model=family, max_output_tokens=MAX_TOKENS, temperature=0, input=turn)
    assert resp.output_text == expected
    # a follow-up by previous_response_id: the stored turn kept its image, so the prompt is the whole conversation's
    follow = client.responses.create(model=family, max_output_tokens=2, temperature=0, previous_response_id=resp.id,
                                     input="And now?")
    whole = client.responses.create(model=family, max_output_tokens=2, temperature=0, input=[
        *turn, {"role": "assistant", "content": resp.output_text}, {"role": "user", "content": "And now?"}])
    assert follow.usage is not None and whole.usage is not None
    assert follow.usage.input_tokens == whole.usage.input_tokens


def test_anthropic_image_block_answers_as_mlx_vlm(daemon: Daemon, family: str, expected: str) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    body = anthropic_body(("image/png", PICTURE), model=family)
    greedy = {"temperature": body.pop("temperature")}  # this SDK's create() takes no temperature; the API does
    msg = client.messages.create(**body, extra_body=greedy)
    assert "".join(b.text for b in msg.content if b.type == "text") == expected
    assert msg.usage.output_tokens == MAX_TOKENS


TEXTS = ["Tell me about the sea.", "Count the stars for me."]
TEXT_TOKENS = 384  # long enough that both are still decoding when the image request joins them, on a loaded box


def test_an_image_request_batched_with_text_requests_answers_as_each_alone(daemon: Daemon, family: str,
                                                                          mlx_vlm_says: tuple[str, list[float]]) -> None:
    """Two text-only requests stream (ignore_eos: they run their whole length); once both are decoding, the image
    request joins their batch. Its tokens and logprobs are mlx-vlm's (a row whose image prefix came from outside
    the batch, at its own positions: Qwen's rope delta in the merged cache), and each text answer is the one it got
    alone. The worker's peak batch size proves the three ran together."""
    expected, logprobs = mlx_vlm_says
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)

    def text_body(prompt: str) -> dict:
        return {"model": family, "max_tokens": TEXT_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True},
                "messages": [{"role": "user", "content": prompt}]}

    alone = [client.chat.completions.create(**text_body(p)).choices[0].message.content for p in TEXTS]
    assert all(alone), alone
    assert daemon.model(family)["peak_batch_size"] < 3  # the earlier tests ran one at a time: the peak is this one's
    decoding = [threading.Event() for _ in TEXTS]
    batched: list[str | None] = [None] * len(TEXTS)

    def stream(i: int) -> None:
        parts = []
        for chunk in client.chat.completions.create(**text_body(TEXTS[i]), stream=True):
            parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if parts[-1]:
                decoding[i].set()
        batched[i] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(i,), name=f"text-{i}") for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(60) for e in decoding), "the text requests did not start decoding"
        image = client.chat.completions.create(**chat_body(data_url(PICTURE), model=family), logprobs=True)
    finally:
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert image.choices[0].message.content == expected
    assert image.choices[0].logprobs is not None and image.choices[0].logprobs.content is not None
    assert np.allclose([t.logprob for t in image.choices[0].logprobs.content], logprobs, atol=1e-4)
    assert batched == alone
    assert wait_for(lambda: daemon.model(family)["peak_batch_size"] >= 3, 10, what="a heartbeat with the batch")


SEEN = {"type": "object", "additionalProperties": False, "required": ["colour", "noisy"],
        "properties": {"colour": {"enum": ["red", "green", "blue", "grey"]}, "noisy": {"type": "boolean"}}}


def test_an_image_request_decodes_under_a_json_schema(daemon: Daemon, family: str) -> None:
    """Constrained decoding as for text: random weights answer with valid JSON only if the grammar held every step
    after the image prefix."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(**{**chat_body(data_url(PICTURE), model=family), "max_tokens": 64},
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "seen", "schema": SEEN}})
    assert resp.choices[0].finish_reason == "stop", resp
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), SEEN)


DESCRIBE = {"type": "function", "function": {"name": "describe", "description": "Say what the picture shows.",
                                             "parameters": SEEN}}


def test_an_image_request_makes_a_forced_tool_call(daemon: Daemon, family: str) -> None:
    """`tool_choice` naming a function: the call comes back valid (the name, arguments by the schema), from Qwen3-VL's
    template, which renders tools, and from Gemma 3's, which writes none (as Google's): the worker writes them into
    the system message itself (worker/tool_fallback.py), as for a text request. The grammar alone would make a valid
    call of a tool the model never saw: the prompt's length shows the definition is in it."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    # 256: a ceiling (the call is 60-80 tokens of these tokenizers), not a limit the test means to reach
    body = {**chat_body(data_url(PICTURE), model=family), "max_tokens": 256, "tools": [DESCRIBE],
            "tool_choice": {"type": "function", "function": {"name": "describe"}}}
    resp = client.chat.completions.create(**body)
    bare = client.chat.completions.create(**{**chat_body(data_url(PICTURE), model=family), "max_tokens": 1})
    assert resp.usage is not None and bare.usage is not None
    # the tool's JSON (at a token per 4 characters at least) is in the prompt: a dropped definition fails this
    assert resp.usage.prompt_tokens - bare.usage.prompt_tokens > len(json.dumps(DESCRIBE)) // 4, (resp.usage, bare.usage)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, resp
    assert calls[0].type == "function" and calls[0].function.name == "describe"
    jsonschema.validate(json.loads(calls[0].function.arguments), SEEN)


def test_a_gemma_sibling_session_with_other_images_picks_up_the_head_its_elder_left(daemon: Daemon) -> None:
    """Sibling sessions (an agent's subagents) share a head of system prompt and tools and branch at the first user
    turn. Gemma 3 keeps its sliding layers only at snapshots, and an image prompt's prefix, head included, is
    prefilled by the worker itself: it stops at the head's last block boundary too, so a sibling with other images
    and other words is a hit through the head (its tools written by the worker: Gemma's template has none),
    answering as it does computed whole. Without that stop, nothing of the elder is reusable."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    system = {"role": "system", "content": "You are the lead agent of a survey of pictures; your subagents each "
                                          "describe one picture in a few words, then report back to you."}

    def ask(seed: int, text: str) -> Any:
        user = {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image_url", "image_url": {"url": data_url(png(picture(seed)))}}]}
        return client.chat.completions.create(model="gemma", messages=[system, user], tools=[DESCRIBE],
                                              max_tokens=MAX_TOKENS, temperature=0, logprobs=True)

    elder = ask(8, "Describe this picture.")
    sibling = ask(9, "What colour is this one?")
    for tier in ("hot", "ssd"):
        httpx.post(f"{daemon.url}/api/{tier}-cache/clear", json={"model": "gemma"}, timeout=60).raise_for_status()
    whole = ask(9, "What colour is this one?")
    assert elder.usage is not None and cached_tokens(whole) == 0
    hit = cached_tokens(sibling)
    assert hit >= BLOCK and hit % BLOCK == 0 and hit < elder.usage.prompt_tokens, (hit, elder.usage)
    assert sibling.choices[0].message == whole.choices[0].message
    got, want = (r.choices[0].logprobs.content for r in (sibling, whole))
    assert got is not None and want is not None
    assert np.allclose([t.logprob for t in got], [t.logprob for t in want], atol=1e-4)


def huge_png(side: int = 20_000) -> bytes:
    """A valid 1-bit PNG of side x side pixels (all black) in ~50 KB: its rows of zeros deflate to almost nothing."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    deflate, row = zlib.compressobj(9), bytes(1 + (side + 7) // 8)  # the filter byte, then the row's bits
    idat = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


JPEG = io.BytesIO()
picture(1).save(JPEG, "JPEG")
BAD = [  # (case, the images as (declared media type, bytes), the model, what the error says)
    ("truncated", [("image/png", PICTURE[:len(PICTURE) // 2])], "vl", "truncated or corrupt"),
    ("huge", [("image/png", huge_png())], "vl", "20000x20000 pixels"),
    ("wrong-media-type", [("image/png", JPEG.getvalue())], "vl", "image/jpeg, not the image/png"),
    ("unsupported-media-type", [("image/tiff", b"II*\x00" + bytes(64))], "vl", "not supported"),
    ("text-model", [("image/png", PICTURE)], "text", "reads no images"),
    ("too-many", [("image/png", PICTURE)] * (MAX_IMAGES + 1), "vl", f"at most {MAX_IMAGES}"),
]


def _openai_error(resp: httpx.Response) -> str:
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"], error
    return error["message"]


def _anthropic_error(resp: httpx.Response) -> str:
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def _requests(images: list[tuple[str, bytes]], model: str) -> list[tuple[str, dict, Any]]:
    """One request per API with these images: (path, body, the reader of its error body)."""
    urls = [data_url(data, media) for media, data in images]
    responses = {"model": model, "max_output_tokens": MAX_TOKENS, "input": [{"role": "user", "content": [
        *({"type": "input_image", "image_url": u} for u in urls), {"type": "input_text", "text": PROMPT}]}]}
    return [("/chat/completions", chat_body(*urls, model=model), _openai_error),
            ("/responses", responses, _openai_error),
            ("/messages", anthropic_body(*images, model=model), _anthropic_error)]


@pytest.mark.parametrize("case, images, model, says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_image_is_a_400_in_each_apis_error_body(daemon: Daemon, case: str, images: list, model: str,
                                                      says: str) -> None:
    for path, body, error_of in _requests(images, model):
        resp = httpx.post(daemon.v1 + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, resp.text)
        assert says in error_of(resp), (path, resp.text)


def test_an_image_url_is_not_fetched_unless_the_config_allows_it(daemon: Daemon) -> None:
    for path, body, error_of in _requests([], "vl"):
        url = "http://127.0.0.1:9/picture.png"  # never reached: refused before any fetch
        if path == "/messages":
            body["messages"][0]["content"].insert(0, {"type": "image", "source": {"type": "url", "url": url}})
        elif path == "/responses":
            body["input"][0]["content"].insert(0, {"type": "input_image", "image_url": url})
        else:
            body["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": url}})
        resp = httpx.post(daemon.v1 + path, json=body, timeout=60)
        assert resp.status_code == 400 and "image_fetch is off" in error_of(resp), (path, resp.text)


def test_bad_images_left_the_vision_worker_as_it_was(daemon: Daemon, mlx_vlm_said: dict) -> None:
    """Runs after the cases above (file order): the worker that answered the first test still serves, with no
    restart or crash, and its footprint did not take in any of the refused images."""
    before = daemon.model("vl")
    for case, images, model, _ in BAD:
        for path, body, _ in _requests(images, model):
            assert httpx.post(daemon.v1 + path, json=body, timeout=60).status_code == 400, case
    after = daemon.model("vl")
    assert after["pid"] == before["pid"] and after["restarts"] == 0 and after["crashes"] == 0, after
    assert after["memory_bytes"] < before["memory_bytes"] + 100 * 2**20, (before, after)  # a decoded huge PNG: 400 MB
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(**chat_body(data_url(PICTURE))).choices[0].message.content
    assert answer == mlx_vlm_said["vl"][0]
