"""The demo answers at its model's defaults when a request names no temperature (issue 49, item 1).

Most clients send none, and at the APIs' 1.0 SmolLM2-135M answered gibberish. `serve --demo` imports the model
with a generation_config.json (greedy for SmolLM2-135M: protocol/sampling.py says why), so the README's curl body
and its openai example, neither naming a temperature, answer the question, whatever the seed; a request at
temperature 0 is greedy and answers as transformers does (tests/fixtures/smollm2/greedy.json); one that sets a
temperature samples.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon

README = Path(__file__).resolve().parents[2] / "README.md"
SEEDS = range(5)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("demo"), "--demo")
    yield d
    assert d.stop() == 0


def readme_curl_body() -> dict:
    """The JSON body of the README's curl for the demo (Set-up)."""
    found = re.search(r"## Set-up\n.*?```sh\ncurl .*?-d '(.*?)'\n```", README.read_text(), re.S)
    assert found, "README.md's Set-up has no curl for the demo"
    body = json.loads(found.group(1))
    assert body["model"] == "demo" and "temperature" not in body
    return body


def test_the_readme_s_curl_body_answers_paris_over_five_seeds(demo: Daemon) -> None:
    body = readme_curl_body()
    for seed in SEEDS:
        r = httpx.post(f"{demo.v1}/chat/completions", json={**body, "seed": seed}, timeout=300)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in text, (seed, text)


def test_the_readme_s_openai_example_answers_paris_with_no_temperature(demo: Daemon) -> None:
    code = re.search(r"## Using it\n.*?```python\n(.*?)```", README.read_text(), re.S)
    assert code and "temperature" not in code.group(1), "the README's example names no temperature"
    source = code.group(1).replace("http://127.0.0.1:8800/v1", demo.v1)
    run = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Paris" in run.stdout, (run.stdout, run.stderr)
    client = openai.OpenAI(base_url=demo.v1, api_key="unused", max_retries=0, timeout=300)
    for seed in SEEDS:  # the example's own call, streamed, with a seed: the same every run
        stream = client.chat.completions.create(model="demo", stream=True, seed=seed, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Paris" in text, (seed, text)


def test_the_sampling_that_applies_is_in_the_model_and_the_status(demo: Daemon) -> None:
    expected = {"temperature": {"value": 0.0, "source": "model"}, "top_p": {"value": 1.0, "source": "server"},
                "top_k": {"value": 0, "source": "server"}, "min_p": {"value": 0.0, "source": "server"},
                "repetition_penalty": {"value": 1.0, "source": "server"}}
    assert httpx.get(f"{demo.v1}/models/demo", timeout=30).json()["sampling"] == expected
    run = subprocess.run([*MLXSUP, "status", "--json", "--url", demo.url], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [model] = [m for m in json.loads(run.stdout)["models"] if m["id"] == "demo"]
    assert model["sampling"] == expected


def test_temperature_0_is_greedy_as_before(demo: Daemon) -> None:
    reference = json.loads((Path(__file__).parents[1] / "fixtures" / "smollm2" / "greedy.json").read_text())
    case = reference["cases"][0]  # "What is the capital of France?": "The capital of France is Paris."
    for seed in (None, 1):
        r = httpx.post(f"{demo.v1}/chat/completions", timeout=300, json={
            "model": "demo", "messages": case["messages"], "max_tokens": 64, "temperature": 0,
            **({"seed": seed} if seed is not None else {})})
        assert r.json()["choices"][0]["message"]["content"] == case["text"], r.text


def test_a_request_that_sets_a_temperature_samples(demo: Daemon) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 16, "temperature": 1.0}
    texts = {httpx.post(f"{demo.v1}/chat/completions", json={**body, "seed": seed}, timeout=300).json()
             ["choices"][0]["message"]["content"] for seed in SEEDS}
    assert len(texts) > 1, texts
