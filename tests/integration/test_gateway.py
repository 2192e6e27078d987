"""The whole path, end to end: the official openai client -> gateway -> router -> real worker -> MLX."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.conftest import Daemon, text_line, wait_for

CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=60)


def test_chat_completion_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same text either way
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completion_and_model_list(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    assert sorted(m.id for m in client.models.list()) == ["tiny", "tiny2"]


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    assert "tiny" in err.value.body["message"]  # names the available ones


def test_invalid_parameters_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x " * 9000, max_tokens=5)
    assert err.value.body["code"] == "context_length_exceeded"


def test_sampling_params_and_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="The sea", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert stop, base
    cut = client.completions.create(model="tiny", prompt="The sea", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[: base.index(stop)]
    sampled = client.completions.create(model="tiny", prompt="The sea", max_tokens=20, temperature=0.8,
                                        top_p=0.9, extra_body={"top_k": 40, "min_p": 0.05, "ignore_eos": True})
    assert sampled.usage.completion_tokens == 20


def test_sixteen_concurrent_streams_share_one_batched_worker(daemon: Daemon) -> None:
    client = openai.AsyncOpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    prompts = [f"Request number {i} asks about {'waves ' * (i % 5)}" for i in range(16)]

    async def one(prompt: str) -> tuple[int, int, int]:
        stream = await client.completions.create(
            model="tiny2", prompt=prompt, max_tokens=300, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        n_chunks, usage = 0, None
        async for chunk in stream:
            n_chunks += bool(chunk.choices and chunk.choices[0].text)
            usage = chunk.usage or usage
        return n_chunks, usage.prompt_tokens, usage.completion_tokens

    async def main() -> list:
        return await asyncio.gather(*(one(p) for p in prompts))

    httpx.post(daemon.v1 + "/completions", json={"model": "tiny2", "prompt": "warm", "max_tokens": 1}, timeout=60)
    pid_before = daemon.model("tiny2")["pid"]
    assert pid_before
    results = asyncio.run(main())
    status = daemon.model("tiny2")
    assert status["pid"] == pid_before, "all 16 requests were served by the one worker process"
    assert all(completion == 300 for _, _, completion in results)
    singles = [httpx.post(daemon.v1 + "/completions", json={"model": "tiny2", "prompt": p, "max_tokens": 1},
                          timeout=30).json()["usage"]["prompt_tokens"] for p in prompts[:3]]
    assert [r[1] for r in results[:3]] == singles
    peak = wait_for(lambda: daemon.model("tiny2")["peak_batch_size"], 10, what="a heartbeat")
    print(f"peak batch size with 16 concurrent streams: {peak}")
    assert peak >= 8, f"requests were not batched (peak batch size {peak})"


REFERENCE = """
import json, sys
from mlx_lm import load, generate
model, tok = load(sys.argv[1])
chat = tok.apply_chat_template(json.loads(sys.argv[3]), add_generation_prompt=True)
print(json.dumps({"completion": generate(model, tok, sys.argv[2], max_tokens=40),
                  "chat": generate(model, tok, chat, max_tokens=40)}))
"""


def test_greedy_output_matches_mlx_lm_in_process(daemon: Daemon, model_dir) -> None:
    prompt = "In the beginning there was"
    ref = json.loads(subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir / "tiny"), prompt,
                                     json.dumps(CHAT)], check=True, capture_output=True, text=True).stdout)
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    assert got.choices[0].text == ref["completion"]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == ref["chat"]


def test_client_disconnect_aborts_in_the_worker(daemon: Daemon) -> None:
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", daemon.v1 + "/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if text_line(line))
        assert daemon.model("tiny")["in_flight"] == 1
    # the connection is closed: the gateway must abort it in the worker and release the lease
    wait_for(lambda: daemon.model("tiny")["in_flight"] == 0 and daemon.model("tiny")["leases"] == 0, 10,
             what="the aborted request to leave the router")
    wait_for(lambda: (m := daemon.model("tiny"))["batch_size"] == 0 and m["queued"] == 0, 10,
             what="the worker to stop generating for it")


def test_status_reports_models(daemon: Daemon) -> None:
    st = daemon.status()
    assert st["version"] and st["uptime_s"] >= 0
    tiny = next(m for m in st["models"] if m["id"] == "tiny")
    for key in ("state", "pid", "in_flight", "memory_bytes"):
        assert key in tiny
    assert httpx.get(daemon.url + "/health").json() == {"status": "ok"}


def test_special_tokens_are_not_text(client: openai.OpenAI, model_dir) -> None:
    """Random weights sample <|pad|>, <|bos|> and turn markers now and then (about 4 in 1000 tokens at
    temperature 1): they count as tokens but never reach `content`."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from worker.template_input import special_token_ids
    from worker.textstream import TextStream

    tok = load_tokenizer(model_dir / "tiny")
    special = special_token_ids(tok)
    names = [tok.convert_ids_to_tokens(i) for i in sorted(special)]
    assert {"<|pad|>", "<|bos|>", "<|im_start|>"} <= set(names)
    ts = TextStream(tok.detokenizer, [], special)
    ids = [*tok.encode("Hello"), *sorted(special), *tok.encode(" world")]
    assert "".join(ts.push(i) for i in ids) + ts.flush() == "Hello world"

    out = client.completions.create(model="tiny", prompt="Tell me", max_tokens=1500, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 1500
    leaked = [name for name in names if name in out.choices[0].text]
    assert not leaked, f"special tokens in the text: {leaked}"


def _sample(metrics: str, name: str, labels: dict[str, str]) -> float:
    """A sample's value in the daemon's /metrics text; 0 when it has none (a labelled series never observed)."""
    from prometheus_client.parser import text_string_to_metric_families

    return next((s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                 if s.name == name and s.labels == labels), 0.0)


def test_a_whole_request_whose_client_leaves_during_the_prefill_is_aborted_before_its_first_token(
        daemon_factory, model_dir, tmp_path) -> None:
    """Issue 25: a non-streamed request used to notice its client's leaving only at its first token."""
    config = tmp_path / "slow.toml"
    config.write_text(f"""
[server]
prefill_step_size = 16

[models.slow]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "slow-steps"]
""")
    d = daemon_factory("--config", str(config))
    assert httpx.post(f"{d.url}/api/models/slow/load", timeout=60).status_code == 200
    prompt = "a long prompt that takes many prefill steps " * 12  # ~10 prefill steps of 0.4 s each

    async def leave_during_the_prefill() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.create_task(http.post(d.v1 + "/completions",
                                                    json={"model": "slow", "prompt": prompt, "max_tokens": 50}))

            async def in_the_worker() -> None:
                while not (await http.get(d.url + "/api/status")).json()["models"][0]["in_flight"]:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # polling the daemon's API: no event to wait on

            await asyncio.wait_for(in_the_worker(), 30)  # polled with a deadline
            request.cancel()  # the client leaves: its connection is closed
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(leave_during_the_prefill())
    wait_for(lambda: (m := d.model("slow"))["in_flight"] == 0 and m["leases"] == 0, 30,
             what="the abandoned request to leave the router")
    wait_for(lambda: (m := d.model("slow"))["batch_size"] == 0 and m["queued"] == 0, 30,
             what="the worker to stop prefilling it")
    metrics = httpx.get(d.url + "/metrics", timeout=10).text
    labels = {"model": "slow", "endpoint": "/v1/completions", "outcome": "disconnected"}
    assert _sample(metrics, "mlxsup_requests_total", labels) == 1
    # closed before its first token: no time to first token was observed, no token generated
    assert _sample(metrics, "mlxsup_time_to_first_token_seconds_count", {"model": "slow"}) == 0
    assert _sample(metrics, "mlxsup_completion_tokens_total", {"model": "slow"}) == 0
