"""Issue 34: an Anthropic `cache_control` breakpoint keeps its prefix in a small hot tier across a burst of
unrelated prompts that evicts the same prefix unmarked, and usage says so (cache_read_input_tokens); so does
OpenAI's `prompt_cache_key`, through the openai SDK (usage's cached_tokens), and a bad key is OpenAI's 400.

One daemon, the tiny llama (2 layers, 2 KV heads of 16, float32: 32 KiB of K/V per 64-token block), its hot tier
sized for about two of these prompts and no SSD tier, so what is not in memory is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import Daemon, start_daemon

BLOCK = 64
BLOCK_BYTES = 2 * 2 * 2 * 16 * BLOCK * 4  # layers * (K, V) * KV heads * head dim * tokens * float32


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("cache_control")
    config = root / "c.toml"
    config.write_text(f'[models.tiny]\npath = "{model_dir / "tiny"}"\n\n'
                      f'[cache]\nssd = false\nhot_budget = {22 * BLOCK_BYTES}\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d
    assert d.stop() == 0


def system(seed: int) -> str:  # about 600 tokens: 9 blocks and a bit
    return f"Rules {seed}: " + " ".join(f"rule{(seed * 7919 + i * 104729) % 9973} holds" for i in range(60))


def ask(d: Daemon, seed: int, question: str, mark: dict | None = None) -> dict:
    block = {"type": "text", "text": system(seed), **({"cache_control": mark} if mark else {})}
    body = {"model": "tiny", "system": [block], "messages": [{"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0}
    r = httpx.post(d.v1 + "/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def session_after_a_burst(d: Daemon, seed: int, mark: dict | None) -> tuple[dict, dict]:
    """(the first turn's usage, the next turn's after five unrelated prompts)."""
    first = ask(d, seed, "Which rule comes first?", mark)
    for other in range(5):
        ask(d, 1000 + 10 * seed + other, "Which rule comes last?")
    return first, ask(d, seed, "Which rule comes second?", mark)


def test_a_marked_prefix_outlives_a_burst_that_evicts_it_unmarked(daemon: Daemon) -> None:
    first, then = session_after_a_burst(daemon, 1, None)
    prompt = first["input_tokens"] + first["cache_creation_input_tokens"] + first["cache_read_input_tokens"]
    assert prompt > 9 * BLOCK and first["cache_read_input_tokens"] < BLOCK, first
    assert then["cache_read_input_tokens"] < BLOCK, then  # evicted: only the template's head is shared

    first, then = session_after_a_burst(daemon, 2, {"type": "ephemeral", "ttl": "5m"})
    assert first["cache_read_input_tokens"] < BLOCK, first
    # kept: the system prompt's whole blocks; only the question and the partial block before it are computed
    assert then["cache_creation_input_tokens"] + then["input_tokens"] < 2 * BLOCK < then["cache_read_input_tokens"], then


def test_a_bad_cache_control_is_anthropic_s_400(daemon: Daemon) -> None:
    for mark in ({"type": "persistent"}, {"type": "ephemeral", "ttl": "2d"}):
        body = {"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": mark}]}]}
        r = httpx.post(daemon.v1 + "/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "cache_control" in r.json()["error"]["message"]


def chat(client: openai.OpenAI, seed: int, question: str, key: str | None = None) -> int:
    """The cached tokens of a chat request: a system prompt of `seed`, then `question`."""
    r = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": system(seed)}, {"role": "user", "content": question}],
        extra_body={"prompt_cache_key": key} if key else None)
    assert r.usage is not None and r.usage.prompt_tokens > 9 * BLOCK, r.usage
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def test_a_prompt_cache_key_keeps_its_prefix_through_a_burst_that_evicts_it_without(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    for seed, key in ((3, None), (4, "session-4")):
        assert chat(client, seed, "Which rule comes first?", key) < BLOCK
        for other in range(5):
            chat(client, 1000 + 10 * seed + other, "Which rule comes last?")
        cached = chat(client, seed, "Which rule comes second?", key)
        if key is None:
            assert cached < BLOCK, cached  # evicted: only the template's head is shared
        else:
            assert cached > 8 * BLOCK, cached  # kept: the system prompt's whole blocks


def test_a_bad_prompt_cache_key_is_openai_s_400(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=60)
    bad = ({"prompt_cache_key": 7}, {"prompt_cache_key": "k" * 1025},
           {"prompt_cache_key": "k", "prompt_cache_retention": "forever"})
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra)
        assert err.value.status_code == 400 and isinstance(err.value.body, dict), err.value
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] in extra, err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tiny", max_output_tokens=4, input="hi", extra_body=extra)
        assert err.value.status_code == 400 and "prompt_cache" in err.value.message
