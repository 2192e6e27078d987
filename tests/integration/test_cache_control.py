"""Issue 34: an Anthropic `cache_control` breakpoint keeps its prefix in a small hot tier across a burst of
unrelated prompts that evicts the same prefix unmarked, and usage says so (cache_read_input_tokens).

One daemon, the tiny llama (2 layers, 2 KV heads of 16, float32: 32 KiB of K/V per 64-token block), its hot tier
sized for about two of these prompts and no SSD tier, so what is not in memory is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
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
