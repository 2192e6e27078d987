"""Ollama's API (issue 51) driven by the real `ollama` Python client against one real daemon, on its second listener
(a free port set by `ollama_listen`, never 11434), behind an API key.

The daemon serves a tiny random-weight llama (`tiny`: text, whole and streamed chat and generate, a schema, keep_alive,
a growing session's prefill), a tiny qwen3 whose worker answers from a script (`qwen3`: a real tool call and a real
thinking block, through the worker's real parser), a tiny Qwen3-VL (`vl`: an image), a tiny embedder (`embedder`),
and pulls from a stand-in hub (`hf.co/ORG/NAME`). Every error is the status and ResponseError Ollama's client raises.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

from tests.conftest import MLXSUP, Daemon, assert_gone, make_model, start_daemon, wait_for
from tests.integration.standin_hub import Repo, StandInHub, folder_files

KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = [{"match": "OLLAMA-WEATHER-RESULT", "reply": "It is sunny in Paris."},
          {"match": "OLLAMA-WEATHER", "reply": CALL},
          {"match": "OLLAMA-THINK", "reply": "<think>\nI ponder.\n</think>\n\nThe answer."}]
GREEDY = {"temperature": 0, "num_predict": 8}
TTL = 3600  # the daemon's default idle TTL, which a keep_alive overrides for the worker it was said to
HI = [{"role": "user", "content": "Tell me a story"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInHub]:
    made = make_model(tmp_path_factory.mktemp("hub-model") / "tiny", seed=3)
    with StandInHub() as h:
        h.repos["mlx-test/Pullme-4bit"] = Repo()
        h.repos["mlx-test/Pullme-4bit"].add(folder_files(made))
        yield h


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, hub: StandInHub) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ollama-models")
    models = root / "dir"
    from worker.mlx_engine.make_model import make_model as make

    make_model(models / "tiny")
    make(models / "embedder", "tiny", arch="qwen3-embedding")
    make(models / "oss", "tiny", arch="gpt_oss")  # harmony: think takes a level
    try:
        make(models / "vl", "tiny", arch="qwen3_vl")
    except ImportError:  # no vision extra: the vision test skips
        pass
    qwen3 = root / "qwen3"
    make(qwen3, "tiny", arch="qwen3")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    state = tmp_path_factory.mktemp("ollama-state")
    port = free_port()
    config = state / "config.toml"
    config.write_text(f'[server]\napi_key = "{KEY}"\nollama_listen = "127.0.0.1:{port}"\ndefault_ttl_s = {TTL}\n\n'
                      f'[models.qwen3]\npath = "{qwen3}"\nworker_args = ["--script", "{script}"]\n')
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "MLXSUP_OLLAMA_LISTEN": f"127.0.0.1:{port}"}
    d = start_daemon(state, "--model-dir", str(models), "--config", str(config), env=env)
    d.ollama = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.ollama, headers=AUTH, timeout=120)  # type: ignore[attr-defined]


def status(daemon: Daemon, model: str) -> dict:
    st = httpx.get(daemon.url + "/api/status", headers=AUTH, timeout=10).json()
    daemon.seen_pids.update(m["pid"] for m in st["models"] if m["pid"])
    return next(m for m in st["models"] if m["id"] == model)


def loaded(client: ollama.Client) -> dict[str, ollama.ProcessResponse.Model]:
    return {m.model or "": m for m in client.ps().models}


# --- the daemon, the listener, the guards ------------------------------------------------------


def test_the_ollama_listener_answers_as_ollama_does_behind_the_same_guards(daemon: Daemon, client: ollama.Client
                                                                          ) -> None:
    url = daemon.ollama  # type: ignore[attr-defined]
    assert httpx.get(url + "/").text == "Ollama is running"  # open, as / is on the main port
    assert httpx.head(url + "/").status_code == 200
    assert httpx.get(daemon.url + "/").text == "Ollama is running"  # the main port answers it too
    assert httpx.get(daemon.url + "/", headers={"accept": "text/html"}).status_code == 307  # a browser: the dashboard
    assert httpx.get(url + "/api/version", headers=AUTH).json()["version"]
    listener = httpx.get(daemon.url + "/api/status", headers=AUTH).json()["ollama_listener"]
    assert listener == {"address": url.removeprefix("http://"), "state": "listening", "error": None}
    with pytest.raises(ollama.ResponseError) as no_key:
        ollama.Client(host=url).list()
    assert no_key.value.status_code == 401 and "API key" in no_key.value.error
    foreign = httpx.get(url + "/api/tags", headers={**AUTH, "host": "evil.example"})
    assert foreign.status_code == 403 and "Host" in foreign.json()["error"]  # Ollama's shape: a string
    page = httpx.post(url + "/api/chat", headers={**AUTH, "origin": "http://evil.example"}, json={"model": "tiny"})
    assert page.status_code == 403 and "origin" in page.json()["error"]
    # the OpenAI routes are there too, as Ollama serves them
    models = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert {"tiny", "qwen3", "embedder"} <= {m["id"] for m in models}


def test_list_and_show_say_what_each_model_really_is(client: ollama.Client) -> None:
    names = {m.model for m in client.list().models}
    assert {"tiny:latest", "qwen3:latest", "embedder:latest"} <= names
    caps = {name: client.show(name).capabilities for name in ("tiny", "qwen3:latest", "embedder")}
    assert caps == {"tiny": ["completion", "tools"], "qwen3:latest": ["completion", "tools", "thinking"],
                    "embedder": ["embedding"]}
    shown = client.show("tiny")
    assert shown.details and shown.details.family == "llama" and shown.details.format == "safetensors"
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] > 0
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("llama3.2:8b")
    assert missing.value.status_code == 404


# --- generation ------------------------------------------------------------------------------------


def test_chat_whole_and_streamed_say_the_same_with_truthful_counts(daemon: Daemon, client: ollama.Client) -> None:
    raw = httpx.post(daemon.url + "/api/chat", headers=AUTH, timeout=60,  # `stream` left out: true, as in Ollama
                     json={"model": "tiny", "messages": HI, "options": GREEDY})
    assert raw.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert len(lines) > 1 and lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])
    whole = client.chat("tiny", messages=HI, options=GREEDY, stream=False)
    parts = list(client.chat("tiny:latest", messages=HI, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content and whole.message.content
    assert whole.model == "tiny" and parts[-1].model == "tiny:latest"
    scored = client.chat("tiny", messages=HI, options=GREEDY, logprobs=True, top_logprobs=2)
    assert scored.logprobs and len(scored.logprobs) == 8 and all(len(e.top_logprobs or []) == 2 for e in scored.logprobs)
    assert "".join(e.token for e in scored.logprobs).lstrip() == whole.message.content  # (the parser drops a leading blank)
    for r in (whole, parts[-1]):
        assert r.done_reason == "length" and r.eval_count == 8
        assert r.prompt_eval_count and r.prompt_eval_count > 0
        assert r.total_duration and r.eval_duration and r.prompt_eval_duration is not None
        assert r.total_duration >= r.eval_duration + r.prompt_eval_duration + (r.load_duration or 0)
        assert r.total_duration < 120 * 10**9  # nanoseconds, and of this request


def test_generate_streamed_whole_raw_and_with_a_system_prompt(client: ollama.Client) -> None:
    whole = client.generate("tiny", "Once upon a time", options=GREEDY, stream=False)
    streamed = list(client.generate("tiny", "Once upon a time", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == whole.response and whole.done and whole.eval_count == 8
    raw = client.generate("tiny", "Once upon a time", raw=True, options=GREEDY)
    assert raw.done and raw.eval_count == 8 and raw.prompt_eval_count and raw.prompt_eval_count < (
        whole.prompt_eval_count or 0) + 1
    system = client.generate("tiny", "Once upon a time", system="You are terse.", options={"num_predict": 2})
    assert system.done and system.eval_count == 2
    stop = client.generate("tiny", "Once upon a time", options={**GREEDY, "stop": [whole.response[2:4]]})
    assert stop.done_reason == "stop" and len(stop.response) < len(whole.response)


def test_a_scripted_tool_call_comes_whole_and_its_result_is_answered(client: ollama.Client) -> None:
    asked = [{"role": "user", "content": "OLLAMA-WEATHER in Paris?"}]
    for stream in (False, True):
        if stream:
            parts = list(client.chat("qwen3", messages=asked, tools=[WEATHER], stream=True))
            calls = [c for p in parts for c in (p.message.tool_calls or [])]
        else:
            calls = list(client.chat("qwen3", messages=asked, tools=[WEATHER]).message.tool_calls or [])
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    history = [*asked, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "OLLAMA-WEATHER-RESULT: sunny", "tool_name": "get_weather"}]
    answer = client.chat("qwen3", messages=history, tools=[WEATHER])
    assert answer.message.content == "It is sunny in Paris." and not answer.message.tool_calls


def test_think_gives_the_thinking_apart_and_a_model_that_cannot_think_refuses(client: ollama.Client) -> None:
    r = client.chat("qwen3", messages=[{"role": "user", "content": "OLLAMA-THINK please"}], think=True)
    assert r.message.thinking and r.message.thinking.strip() == "I ponder."
    assert r.message.content and r.message.content.strip() == "The answer."
    parts = list(client.generate("qwen3", "OLLAMA-THINK please", think=True, stream=True))
    assert "".join(p.thinking or "" for p in parts).strip() == "I ponder."
    assert "".join(p.response for p in parts).strip() == "The answer."
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat("tiny", messages=HI, think=True)
    assert refused.value.status_code == 400 and "does not support thinking" in refused.value.error
    assert "thinking" in (client.show("oss").capabilities or [])
    for level in ("low", "high"):  # gpt-oss's levels: its template's reasoning_effort
        r = client.chat("oss", messages=HI, think=level, options={"num_predict": 6, "temperature": 0})
        assert r.done and r.eval_count == 6


def test_a_schema_format_is_held_by_the_grammar_on_random_weights(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    r = client.chat("tiny", messages=HI, format=schema, options={"num_predict": 40})
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    g = client.generate("tiny", "Say it", format=schema, options={"num_predict": 40})
    jsonschema.validate(json.loads(g.response), schema)
    j = client.chat("tiny", messages=HI, format="json", options={"num_predict": 6})
    assert (j.message.content or "").lstrip().startswith("{")


def test_an_image_reaches_a_vision_model_and_a_text_model_refuses_it(client: ollama.Client) -> None:
    if "vl" not in {m.model.removesuffix(":latest") for m in client.list().models if m.model}:
        pytest.skip("no vision extra (mlx-vlm)")
    from tests.integration.test_vision import picture, png

    image = png(picture(0))
    assert "vision" in (client.show("vl").capabilities or [])
    r = client.chat("vl", messages=[{"role": "user", "content": "Describe this.", "images": [image]}],
                    options={"num_predict": 4, "temperature": 0})
    assert r.done and r.eval_count == 4
    g = client.generate("vl", "Describe this.", images=[base64.b64encode(image).decode()], options={"num_predict": 2})
    assert g.done and g.eval_count == 2
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat("tiny", messages=[{"role": "user", "content": "x", "images": [image]}])
    assert refused.value.status_code == 400 and "reads no images" in refused.value.error


def test_embed_and_the_older_embeddings_on_an_embedder(client: ollama.Client) -> None:
    r = client.embed("embedder", input=["first text", "second text"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 0
    assert r.prompt_eval_count and r.prompt_eval_count > 0
    one = client.embeddings("embedder", prompt="first text")
    assert one.embedding == pytest.approx(r.embeddings[0], abs=1e-5)
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed("tiny", input="x")
    assert refused.value.status_code == 400 and "does not support embeddings" in refused.value.error


def test_errors_are_ollamas_shape_and_status(daemon: Daemon, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat("gpt-99", messages=HI)
    assert unknown.value.status_code == 404 and unknown.value.error == "model 'gpt-99' not found"
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat("tiny", messages=HI, options={"temperature": "hot"})
    assert bad.value.status_code == 400 and "temperature" in bad.value.error
    url = daemon.ollama  # type: ignore[attr-defined]
    for path, body in (("/api/chat", b"{"), ("/api/generate", b"[]"), ("/api/chat", b'{"model": "tiny", "messages": 1}'),
                       ("/api/embed", b'{"model": "embedder"}'), ("/api/show", b"{}")):
        r = httpx.post(url + path, content=body, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (path, r.text)


# --- keep_alive ---------------------------------------------------------------------------------


def test_keep_alive_zero_unloads_negative_keeps_and_a_duration_is_the_ttl(daemon: Daemon, client: ollama.Client
                                                                          ) -> None:
    client.chat("tiny", messages=HI, options={"num_predict": 1}, keep_alive="10m")
    entry = loaded(client)["tiny:latest"]
    assert entry.expires_at is not None
    left = entry.expires_at - datetime.now(UTC)
    assert timedelta(minutes=9) < left <= timedelta(minutes=10) and entry.context_length
    assert status(daemon, "tiny")["ttl_s"] == 600
    shown = subprocess.run([*MLXSUP, "status", "--url", daemon.url], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "MLXSUP_API_KEY": KEY})
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.startswith("tiny "))
    assert re.search(r"in (9m\d\ds|10m00s)", row), row  # `mlxsup status` shows the TTL keep_alive set
    assert f"Ollama's API also on {daemon.ollama}" in shown.stdout  # type: ignore[attr-defined]
    client.generate("tiny", "Hi", options={"num_predict": 1}, keep_alive=-1)
    entry = loaded(client)["tiny:latest"]
    assert entry.expires_at is not None and entry.expires_at.year > 2100
    assert status(daemon, "tiny")["ttl_s"] is None
    pid = status(daemon, "tiny")["pid"]
    client.chat("tiny", messages=HI, options={"num_predict": 1}, keep_alive=0)
    wait_for(lambda: status(daemon, "tiny")["state"] == "stopped", 30, what="keep_alive 0 to unload tiny")
    assert "tiny:latest" not in loaded(client) and status(daemon, "tiny")["last_eviction"]["reason"] == "keep_alive"
    assert_gone([pid])
    assert client.generate("tiny", "").done_reason == "load" and "tiny:latest" in loaded(client)  # an empty prompt
    assert status(daemon, "tiny")["ttl_s"] == TTL  # a new worker: the model's own TTL again, until a keep_alive
    assert client.generate("tiny", "", keep_alive=0).done_reason == "unload"  # answered once it is gone
    assert "tiny:latest" not in loaded(client) and status(daemon, "tiny")["state"] == "stopped"


# --- a session's prefill ----------------------------------------------------------------------------


def test_a_growing_chat_session_prefills_only_its_new_tokens(daemon: Daemon, client: ollama.Client) -> None:
    block = httpx.get(daemon.url + "/api/config", headers=AUTH).json()["config"]["cache"]["block_tokens"]
    count = daemon.url + "/v1/messages/count_tokens"
    messages: list[dict] = [{"role": "system", "content": "You tell long stories. " * 40}]
    before = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: go on with the story, please."})
        r = client.chat("tiny", messages=messages, options={"num_predict": 6, "temperature": 0})
        total = httpx.post(count, headers=AUTH, json={"model": "tiny", "system": messages[0]["content"],
                                                      "messages": messages[1:], "max_tokens": 1}).json()["input_tokens"]
        assert r.prompt_eval_count is not None
        if turn == 0:
            assert r.prompt_eval_count >= total - block  # cold: all of it (less a block a warm-up may hold)
        else:
            assert 0 < r.prompt_eval_count <= total - before + block, (turn, r.prompt_eval_count, total, before)
        messages.append({"role": "assistant", "content": r.message.content})
        before = total


# --- pull, copy, delete ----------------------------------------------------------------------------


def test_pull_from_the_hub_with_ollamas_progress_then_copy_and_delete(client: ollama.Client) -> None:
    statuses = list(client.pull("hf.co/mlx-test/Pullme-4bit", stream=True))
    said = [s.status for s in statuses]
    assert said[0] == "pulling manifest" and said[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layers = [s for s in statuses if (s.status or "").startswith("pulling ") and s.digest]
    assert layers and all(s.digest and s.digest.startswith("sha256:") and s.total for s in layers)
    assert any(s.completed == s.total for s in layers)
    assert "mlx-test/Pullme-4bit:latest" in {m.model for m in client.list().models}
    assert client.show("hf.co/mlx-test/Pullme-4bit").capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as not_hf:
        client.pull("llama3.2")
    assert not_hf.value.status_code == 400 and "file does not exist" in not_hf.value.error
    with pytest.raises(ollama.ResponseError) as quant:  # Ollama's GGUF quant tag is no revision of an MLX repo
        client.pull("hf.co/mlx-test/Pullme-4bit:Q4_K_M")
    assert quant.value.status_code == 400 and "GGUF quantization" in quant.value.error
    assert client.copy("hf.co/mlx-test/Pullme-4bit", "mine").status == "success"
    assert "mine:latest" in {m.model for m in client.list().models}
    assert client.show("mine:latest").details.family == "llama"  # type: ignore[union-attr]
    assert client.delete("mine").status == "success"  # a copy: its name goes, the model stays
    names = {m.model for m in client.list().models}
    assert "mine:latest" not in names and "mlx-test/Pullme-4bit:latest" in names
    assert client.delete("hf.co/mlx-test/Pullme-4bit").status == "success"
    assert "mlx-test/Pullme-4bit:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as gone:
        client.delete("hf.co/mlx-test/Pullme-4bit")
    assert gone.value.status_code == 404


# --- the frameworks that speak Ollama's API ----------------------------------------------------------


def test_langchain_chat_ollama_with_tools_and_ollama_embeddings(daemon: Daemon) -> None:
    langchain_ollama = pytest.importorskip("langchain_ollama")
    url = daemon.ollama  # type: ignore[attr-defined]
    chat = langchain_ollama.ChatOllama(model="qwen3", base_url=url, client_kwargs={"headers": AUTH})
    asked = chat.bind_tools([WEATHER]).invoke("OLLAMA-WEATHER in Paris?")
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("get_weather", {"city": "Paris"})]
    said = langchain_ollama.ChatOllama(model="tiny", base_url=url, client_kwargs={"headers": AUTH}, num_predict=4,
                                       temperature=0).invoke("Tell me a story")
    assert said.content and said.usage_metadata and said.usage_metadata["output_tokens"] == 4
    embeddings = langchain_ollama.OllamaEmbeddings(model="embedder", base_url=url, client_kwargs={"headers": AUTH})
    vectors = embeddings.embed_documents(["first text", "second text"])
    assert len(vectors) == 2 and len(vectors[0]) == len(embeddings.embed_query("first text")) > 0


def test_litellm_ollama_chat_provider(daemon: Daemon) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at litellm's import: else it fetches one
    litellm = pytest.importorskip("litellm")
    url = daemon.ollama  # type: ignore[attr-defined]
    r = litellm.completion(model="ollama_chat/tiny", api_base=url, api_key=KEY, messages=HI, max_tokens=4,
                           temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
    parts = list(litellm.completion(model="ollama_chat/tiny", api_base=url, api_key=KEY, messages=HI, max_tokens=4,
                                    temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
    called = litellm.completion(model="ollama_chat/qwen3", api_base=url, api_key=KEY, tools=[WEATHER],
                                messages=[{"role": "user", "content": "OLLAMA-WEATHER in Paris?"}])
    calls = called.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


OLLAMA_JS = "0.6.4"  # the npm `ollama` client (ollama-js), pinned


@pytest.fixture(scope="module")
def ollama_js() -> Path:
    """ollama-js installed once into ~/.cache/mlxsup-test-ollama-js/VERSION (skipped where npm cannot install it)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxsup-test-ollama-js" / OLLAMA_JS
    if (root / "node_modules" / "ollama" / "package.json").is_file():
        return root
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("npm and node are needed for the npm ollama client")
    partial = root.with_name(f"{OLLAMA_JS}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    done = subprocess.run([npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(partial),
                           f"ollama@{OLLAMA_JS}"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.skip(f"npm could not install ollama@{OLLAMA_JS}: {(done.stdout + done.stderr)[-500:]}")
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def test_the_npm_ollama_client_drives_the_same_api(daemon: Daemon, ollama_js: Path) -> None:
    script = Path(__file__).with_name("ollama_js_drive.mjs")
    run = subprocess.run(["node", str(script), daemon.ollama, KEY], capture_output=True, text=True,  # type: ignore[attr-defined]
                         timeout=300, env={**os.environ, "OLLAMA_JS": str(ollama_js)})
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    assert {"tiny:latest", "qwen3:latest", "embedder:latest"} <= set(said["list"])
    assert said["show"] == ["completion", "tools", "thinking"]
    assert said["chat"]["content"] == said["chat_streamed"] and said["chat"]["eval_count"] == 8
    assert said["generate"] == said["generate_streamed"] and said["generate"]
    assert said["tool_calls"] == [["get_weather", {"city": "Paris"}]]
    assert [s.strip() for s in said["think"]] == ["I ponder.", "The answer."]
    assert json.loads(said["format"])["answer"] in ("yes", "no")
    assert said["embed"] == 2 and "tiny:latest" in said["ps"]
    assert said["copied"] and said["deleted"]
    assert said["unknown"] == ["ResponseError", 404, "model 'gpt-99' not found"]


def test_create_from_an_uploaded_gguf_is_mlxsup_import(client: ollama.Client, tmp_path: Path) -> None:
    from tests.families.test_gguf_import import made_model, write_gguf

    gguf_file = tmp_path / "made.gguf"
    write_gguf(made_model(tmp_path, "qwen3"), gguf_file, {})
    digest = client.create_blob(gguf_file)  # HEAD, then the upload: its bytes checked against the digest
    assert digest.startswith("sha256:") and client.create_blob(gguf_file) == digest
    statuses = [s.status for s in client.create("made", files={"made.gguf": digest}, stream=True)]
    assert statuses[0] == "parsing GGUF" and statuses[-1] == "success", statuses
    assert "made:latest" in {m.model for m in client.list().models}
    assert "thinking" in (client.show("made").capabilities or [])
    assert client.generate("made", "Hi", options={"num_predict": 2}).eval_count == 2
    with pytest.raises(ollama.ResponseError) as again:
        client.create("made", files={"made.gguf": digest})
    assert again.value.status_code == 400 and "exists already" in again.value.error
    with pytest.raises(ollama.ResponseError) as modelfile:
        client.create("other", from_="made", system="You are a pirate.")
    assert modelfile.value.status_code == 400 and "system" in modelfile.value.error
    assert client.create("made-too", from_="made").status == "success"  # a new name, as /api/copy gives
    assert client.delete("made-too").status == "success" and client.delete("made").status == "success"
    assert "made:latest" not in {m.model for m in client.list().models}
    forged = httpx.post(client._client.base_url.join("/api/blobs/sha256:" + "0" * 64), content=b"not those bytes",
                        headers=AUTH)
    assert forged.status_code == 400 and "digest" in forged.json()["error"]
