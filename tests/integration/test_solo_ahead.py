"""`--solo ahead` in a real worker process (auto where MLX runs on CUDA; asked for here, on the CPU): a lone request's
next decode graph is built on a thread of its own (worker/mlx_engine/solo.py's Ahead). Over HTTP it says what plain
decoding says, streamed and whole, its finished cache serves the conversation's next turn, and a client that leaves
mid-stream leaves a worker that goes on.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from tests.conftest import wait_for

ASK = [{"role": "user", "content": "Tell me about the sea."}]


def chat(d, model: str, messages: list, stream: bool = False, stop: str | None = None) -> tuple[str, dict]:
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stop": [stop]} if stop else {})}
    if not stream:
        r = httpx.post(d.v1 + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]
    body["stream_options"] = {"include_usage": True}
    text, usage = "", {}
    with httpx.stream("POST", d.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    text += choice["delta"].get("content") or ""
                usage = event.get("usage") or usage
    return text, usage


def test_a_worker_building_each_graph_ahead_serves_what_plain_decoding_does(daemon_factory, model_dir: Path,
                                                                            tmp_path: Path) -> None:
    tiny = model_dir / "tiny"
    config = tmp_path / "c.toml"
    config.write_text(f'[models.ahead]\npath = "{tiny}"\nworker_args = ["--solo", "ahead"]\n\n'
                      f'[models.plain]\npath = "{tiny}"\nworker_args = ["--solo", "plain"]\n')
    d = daemon_factory("--config", str(config))
    said = {model: chat(d, model, ASK) for model in ("plain", "ahead")}
    assert said["ahead"][0] == said["plain"][0] and said["ahead"][1]["completion_tokens"] == 24
    assert chat(d, "ahead", ASK, stream=True)[0] == said["plain"][0]

    # a stop string ends the first turn mid-decode, a graph built ahead: undone before its cache is stored; the next
    # turn finds as many cached tokens, and says what plain decoding says after it
    text = said["plain"][0]
    stop = next(text[i:i + 3] for i in range(8, len(text) - 3) if text[i:i + 3] not in text[:i + 2])
    first = {model: chat(d, model, ASK, stop=stop) for model in ("plain", "ahead")}
    assert first["ahead"] == first["plain"] and first["plain"][1]["completion_tokens"] < 22
    turn = [*ASK, {"role": "assistant", "content": first["plain"][0]}, {"role": "user", "content": "And the sky?"}]
    nxt = {model: chat(d, model, turn) for model in ("plain", "ahead")}
    assert nxt["ahead"][0] == nxt["plain"][0]
    cached = nxt["ahead"][1].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached > 0 and cached == nxt["plain"][1].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    async def leave_mid_stream() -> None:  # the client goes after a few deltas: the worker aborts it mid-decode
        body = {"model": "ahead", "messages": ASK, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", d.v1 + "/chat/completions",
                                                                     json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n >= 5:
                    break

    asyncio.run(leave_mid_stream())
    wait_for(lambda: d.model("ahead")["in_flight"] == 0, 30, what="the abandoned request to leave")
    assert chat(d, "ahead", ASK)[0] == said["plain"][0]  # the worker goes on, and says the same again
