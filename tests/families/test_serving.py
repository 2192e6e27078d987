"""Each family served end to end: the openai client -> gateway -> a real worker -> MLX on CPU.

Greedy chats must come back text for text as `mlx_lm.generate` writes them in process (less the
special tokens, which the server never sends as text), with the same token count and finish
reason: eight at once (batched in one worker), and a long prompt that wraps the tiny presets'
32-token sliding windows. The long prompt sent again must reuse its cached prefix, from the hot
cache and, after an evict, from the SSD cache of a new worker. One daemon serves every family's
tiny model from `--model-dir`; each model is evicted when its tests are done, so workers do not
pile up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from mlx_lm import load, stream_generate

from tests.conftest import Daemon, start_daemon, wait_for
from worker.chat_format import family_of, parser_for, starts_in_think
from worker.template_input import special_token_ids

SERVED = ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "qwen3_5", "qwen3-4bit", "qwen3_5-4bit"]
CHATS = [[{"role": "system", "content": "You answer in one line."},
          {"role": "user", "content": f"Name {n} colors and a fruit."}]
         for n in ("three", "two", "four", "five", "six", "seven", "eight", "nine")]
LONG = [{"role": "user", "content": "Story: " + " ".join(f"keeper{i * 104729 % 9973} saw" for i in range(14))}]
MAX_TOKENS = 16
@pytest.fixture(scope="module")
def families_daemon(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("families-state"), "--model-dir", str(family_models))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module", params=SERVED)
def served(request: pytest.FixtureRequest, families_daemon: Daemon, family_models: Path) -> Iterator[tuple]:
    """A model's name and its in-process mlx-lm copy; evicted from the daemon when its tests are done."""
    name = request.param
    model, tok = load(str(family_models / name))
    yield name, model, tok
    httpx.post(f"{families_daemon.url}/api/models/{name}/evict", json={"mode": "now"}, timeout=60)


def reference(model: object, tok: object, messages: list[dict]) -> tuple[str, int, str]:
    """mlx_lm's greedy chat completion: (its answer text, generated tokens, finish reason). The answer is its text
    less special tokens, read by the family's output parser as the worker reads it (reasoning and harmony's
    headers are not answer)."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    responses = list(stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS))
    text = "".join(r.text for r in responses)
    family = family_of(tok)
    for name in {tok.convert_ids_to_tokens(i) for i in special_token_ids(tok) - family.visible_specials}:
        text = text.replace(name, "")
    parser = parser_for(family, chat=True, tools=False, in_think=starts_in_think(family, tok.decode(prompt[-4:])))
    answer = parser.feed(text).content + parser.finish().content
    finish = responses[-1].finish_reason
    return answer, len(responses) - (finish == "stop"), finish


def as_served(completion: object) -> tuple[str, int, str]:
    return completion.choices[0].message.content, completion.usage.completion_tokens, completion.choices[0].finish_reason


def client(d: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)


def test_serves_batched_greedy_chats_like_mlx_lm(families_daemon: Daemon, served: tuple) -> None:
    name, model, tok = served
    expected = [reference(model, tok, chat) for chat in CHATS]
    assert expected[0][1] >= 4, f"the reference ended after {expected[0][1]} tokens: too short to compare"

    async def chats() -> list:
        c = client(families_daemon)
        return await asyncio.gather(*[c.chat.completions.create(model=name, messages=chat, max_tokens=MAX_TOKENS,
                                                                temperature=0) for chat in CHATS])

    assert [as_served(c) for c in asyncio.run(chats())] == expected
    wait_for(lambda: families_daemon.model(name)["peak_batch_size"] >= 2, 10, what="a heartbeat showing a batch")


def test_long_prompt_again_reuses_its_cached_prefix_from_memory_then_from_ssd(families_daemon: Daemon,
                                                                             served: tuple) -> None:
    """Hot: the same worker again. SSD: after an evict (whose orderly exit flushes the SSD writer) a new
    worker with an empty hot cache. Models with sliding-window or recurrent layers reuse the prefix up to
    the snapshot taken at the prompt's last block boundary."""
    name, model, tok = served
    expected = reference(model, tok, LONG)

    async def twice() -> list:
        c = client(families_daemon)
        return [await c.chat.completions.create(model=name, messages=LONG, max_tokens=MAX_TOKENS, temperature=0)
                for _ in range(2)]

    first, again = asyncio.run(twice())
    assert as_served(first) == as_served(again) == expected  # past the sliding windows, cached or not
    assert first.usage.prompt_tokens > 128  # two cache blocks, four times the tiny sliding windows
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    pid = families_daemon.model(name)["pid"]
    report = httpx.post(f"{families_daemon.url}/api/models/{name}/evict", json={"mode": "drain"}, timeout=60).json()
    assert report["exit"] == 0, report

    async def once() -> object:
        return await client(families_daemon).chat.completions.create(model=name, messages=LONG,
                                                                      max_tokens=MAX_TOKENS, temperature=0)

    reloaded = asyncio.run(once())
    assert families_daemon.model(name)["pid"] != pid
    assert as_served(reloaded) == expected
    # from SSD, what memory gave: the partial last block of a model whose layers are all KV is on disk too
    reused = again.usage.prompt_tokens_details.cached_tokens
    assert reloaded.usage.prompt_tokens_details.cached_tokens == reused


def test_the_context_length_comes_from_the_model_s_own_config(families_daemon: Daemon, served: tuple,
                                                              family_models: Path) -> None:
    """Qwen3.5 keeps its text model's fields under `text_config`: its context is not the 4096 fallback."""
    import json

    name, _, _ = served
    config = json.loads((family_models / name / "config.json").read_text())
    expected = {**config, **(config.get("text_config") or {})}["max_position_embeddings"]
    httpx.post(f"{families_daemon.url}/api/models/{name}/load", timeout=120).raise_for_status()
    assert families_daemon.model(name)["context_length"] == expected
