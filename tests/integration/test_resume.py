"""Requests that outlive their worker (supervisor/resume.py), with real workers: a greedy stream whose
worker is SIGKILLed, hang-killed (SIGSTOP) or evicted under hard memory pressure completes with the
text of an uninterrupted run and its usage counted once; a crash loop and a third resume still fail,
with today's error (an explicit `evict --now` failing its streams at once, as before, is
test_lifecycle.py's test_evict_now_during_eight_streams, run with resumes on). Each test fails when
the suspension or the continuation is removed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from tests.conftest import Daemon, assert_gone, wait_for

PROMPT = "Tell me a story"
TOKENS = 300  # tiny makes ~50-500 tokens a second here (a shared CPU): a kill after the first chunk lands mid-run
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def load(d: Daemon, model: str) -> int:
    r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def config(tmp_path: Path, model_dir: Path, extra: str = "") -> str:
    path = tmp_path / "resume.toml"
    path.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\n{extra}')
    return str(path)


def reference(d: Daemon, model: str = "tiny", tokens: int = TOKENS) -> openai.types.Completion:
    """The uninterrupted run: the text a resumed stream must reproduce."""
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, **GREEDY)
    assert done.usage is not None and done.usage.completion_tokens == tokens
    return done


@dataclass
class Streamed:
    text: str = ""
    chunks: int = 0
    usage: dict = field(default_factory=dict)
    error: dict | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between text chunks, as the client saw them
    comments: list[str] = field(default_factory=list)  # SSE comments (": resuming ...")

    @property
    def pause(self) -> float:
        return max(self.gaps, default=0.0)


def stream(d: Daemon, fault_after: dict[int, Callable[[], None]], model: str = "tiny",
           tokens: int = TOKENS) -> Streamed:
    """Stream a greedy completion, reading the SSE lines themselves (comments too); after the chunk
    numbered k (1-based), call fault_after[k]()."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out, last = Streamed(), None
    with httpx.stream("POST", d.v1 + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(":"):
                out.comments.append(line)
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out.error = data["error"]
                break
            if data.get("usage"):
                out.usage = data["usage"]
            if not data["choices"] or not data["choices"][0]["text"]:
                continue
            now = time.monotonic()
            if last is not None:
                out.gaps.append(now - last)
            last = now
            out.text += data["choices"][0]["text"]
            out.chunks += 1
            if out.chunks in fault_after:
                fault_after[out.chunks]()
    return out


def kill(d: Daemon, model: str = "tiny", times: int = 1) -> Callable[[], None]:
    """SIGKILL the model's worker (its pid read now, so the kill itself waits for nothing), then (times > 1)
    each worker the request resumes on, once it runs there."""
    first = d.model(model)["pid"]
    assert first, f"{model} must be loaded"

    def act() -> None:
        os.kill(first, signal.SIGKILL)
        for resumed in range(1, times):
            def running(after: int = resumed) -> int | None:
                m = d.model(model)
                return m["pid"] if m["resumed"] == after and m["in_flight"] else None

            pid = wait_for(running, 60, interval=0.005, what=f"the request to run on a worker ({resumed} resumes)")
            os.kill(pid, signal.SIGKILL)
    return act


def test_a_stream_whose_worker_is_killed_resumes_with_the_text_of_an_uninterrupted_run(daemon_factory,
                                                                                       model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, model_dir, "restart_backoff_s = 0.05\n"))
    other = load(d, "tiny2")
    # 2000 tokens: with 300, a client that read its first chunk late (a loaded CI machine) killed a worker that had
    # already finished the stream, and nothing was left to resume (seen once in CI)
    ref = reference(d, tokens=2000)
    victim = d.model("tiny")["pid"]
    got = stream(d, {1: kill(d)}, tokens=2000)
    assert got.error is None, got.error
    assert got.text == ref.choices[0].text  # nothing repeated, nothing lost
    assert got.usage["completion_tokens"] == 2000 and got.usage["prompt_tokens"] == ref.usage.prompt_tokens
    print(f"the stream paused {got.pause:.2f}s across the SIGKILL (longest gap between chunks)")
    assert_gone([victim])
    status = d.model("tiny")
    assert status["crashes"] == 1 and status["resumed"] == 1 and status["suspended"] == 0
    assert status["pid"] not in (None, victim) and d.model("tiny2")["pid"] == other
    log = (d.state_dir / "daemon.log").read_text()
    assert "suspended why=crash" in log and "flowing again" in log and "paused" in log
    metrics = httpx.get(d.url + "/metrics", timeout=10).text
    assert 'mlxsup_suspended_requests_total{cause="crash",model="tiny"} 1.0' in metrics
    assert 'mlxsup_resumes_total{model="tiny",outcome="resumed"} 1.0' in metrics

    # a whole (non-streamed) request resumes too: its client only waits longer. Its worker is stopped (SIGSTOP)
    # before it is sent, so the kill surely finds it in flight: even 300 tokens can take less than one status poll
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)
    pid = d.model("tiny")["pid"]
    result: dict = {}
    os.kill(pid, signal.SIGSTOP)
    whole = threading.Thread(target=lambda: result.update(done=client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2000, **GREEDY)))
    whole.start()
    wait_for(lambda: d.model("tiny")["in_flight"], 30, interval=0.005, what="the request to reach the worker")
    os.kill(pid, signal.SIGKILL)
    whole.join(120)
    assert result["done"].choices[0].text == ref.choices[0].text
    assert result["done"].usage.completion_tokens == 2000
    assert d.model("tiny")["resumed"] == 2


def test_a_hung_worker_killed_under_a_stream_resumes_it(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, model_dir,
                                          "heartbeat_s = 0.2\nhang_timeout_s = 2.0\nhousekeeping_s = 0.1\n"))
    # 2000 tokens: the stack dump before the kill lets the stopped worker run (SIGCONT) for a moment; with 300 it
    # could finish its stream then, and nothing was left to resume (seen once in CI)
    ref = reference(d, tokens=2000)
    victim = d.model("tiny")["pid"]
    got = stream(d, {1: lambda: os.kill(victim, signal.SIGSTOP)}, tokens=2000)
    assert got.error is None, got.error
    assert got.text == ref.choices[0].text and got.usage["completion_tokens"] == 2000
    assert got.pause >= 2.0  # it was detected as hung first (hang_timeout_s)
    print(f"the stream paused {got.pause:.2f}s across the hang (timeout 2.0s), kill and resume")
    assert_gone([victim])
    status = d.model("tiny")
    assert "hung" in status["last_error"] and status["resumed"] == 1
    assert "suspended why=hang" in (d.state_dir / "daemon.log").read_text()


def test_a_stream_evicted_under_hard_memory_pressure_resumes_once_it_is_over(daemon_factory, model_dir: Path,
                                                                              tmp_path: Path) -> None:
    in_use = tmp_path / "memory-in-use"  # supervisor/memory.py reads the system's memory in use from it
    d = daemon_factory("--config", config(tmp_path, model_dir, "housekeeping_s = 0.05\nsse_keepalive_s = 0.2\n"),
                       env={"MLXSUP_TEST_MEMORY_IN_USE": str(in_use)})
    ref = reference(d)
    victim = d.model("tiny")["pid"]

    def pressure_then_relief() -> None:
        in_use.write_text("0.99")  # past pressure_hard (0.97): the busy worker is evicted
        wait_for(lambda: d.model("tiny")["suspended"] == 1, 15, what="the request to be suspended")
        assert_gone([victim])
        assert d.model("tiny")["state"] == "stopped"  # no reload while the pressure lasts
        in_use.unlink()

    got = stream(d, {1: pressure_then_relief})
    assert got.error is None, got.error
    assert got.text == ref.choices[0].text and got.usage["completion_tokens"] == TOKENS
    status = d.model("tiny")
    assert status["last_eviction"]["reason"] == "pressure-hard" and status["resumed"] == 1
    assert status["crashes"] == 0
    assert any(c.startswith(": resuming tiny: its model was evicted under memory pressure") for c in got.comments)
    assert "suspended why=pressure" in (d.state_dir / "daemon.log").read_text()


def test_a_crash_loop_still_fails_a_suspended_request_with_todays_error(daemon_factory, model_dir: Path,
                                                                       tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, model_dir, "restart_backoff_s = 0.05\ncrash_limit = 2\n"))
    load(d, "tiny")
    got = stream(d, {1: kill(d, times=2)}, tokens=2000)  # the second crash in the window marks the model failed
    assert got.error is not None and got.error["code"] == "worker_crashed", got
    assert "marked failed" in got.error["message"]
    status = d.model("tiny")
    assert status["state"] == "failed" and status["resumed"] == 1 and status["resume_failed"] == 1


def test_a_request_that_would_resume_a_third_time_fails_cleanly(daemon_factory, model_dir: Path,
                                                                tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, model_dir, "restart_backoff_s = 0.05\ncrash_limit = 10\n"))
    load(d, "tiny")
    got = stream(d, {1: kill(d, times=3)}, tokens=2000)
    assert got.error is not None and got.error["code"] == "worker_crashed", got
    assert "resumed 2 time(s) already (max_resumes 2)" in got.error["message"]
    status = wait_for(lambda: (m := d.model("tiny"))["resume_failed"] and m, 10, what="the failure to be counted")
    assert status["resumed"] == 2 and status["suspended"] == 0 and status["crashes"] == 3


def test_the_engine_continues_the_text_exactly_from_every_chunk(model_dir: Path) -> None:
    """In one process, no supervisor: from each chunk boundary of a greedy run (stop strings, held-back text
    and split UTF-8 included), a continuation with that chunk's ids as resume_tokens completes the very
    text of the whole run, and counts each token once. Catches a text stream not replayed (repeated or
    lost bytes), resume tokens not appended, or usage counted twice."""
    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine

    engine = Engine(model_dir / "tiny")

    def run(rid: str, max_tokens: int, stop: list[str], resume: list[int]) -> tuple[list[tuple[str, list]], object]:
        engine.submit(Submit(rid, max_tokens, prompt=PROMPT, temperature=0.0, ignore_eos=True, stop=stop,
                             resume_tokens=resume))
        chunks: list[tuple[str, list]] = []
        while True:
            out, finished = engine.step()
            chunks += [(text, ids) for _, text, _, ids in out]
            if finished:
                return chunks, finished[0]

    whole, _ = run("ref", 32, [], [])
    text = "".join(t for t, _ in whole)
    stop = text[len(text) * 2 // 3:][:3]  # a stop string the run meets late: text is held back before it
    for stop_strings in ([], [stop]):
        chunks, fin = run("ref", 32, stop_strings, [])
        expected = "".join(t for t, _ in chunks) + fin.text
        assert fin.finish_reason == ("stop" if stop_strings else "length")
        for k in range(1, len(chunks)):
            sent = "".join(t for t, _ in chunks[:k])
            ids = [i for _, chunk_ids in chunks[:k] for i in chunk_ids]
            rest, end = run(f"r{k}", 32 - len(ids), stop_strings, ids)
            assert sent + "".join(t for t, _ in rest) + end.text == expected, (stop_strings, k)
            assert end.finish_reason == fin.finish_reason and end.prompt_tokens == fin.prompt_tokens
            assert end.completion_tokens == fin.completion_tokens


def test_a_seeded_request_continues_its_random_stream(model_dir: Path) -> None:
    """Sampled at temperature 1 with a seed: a continuation from any chunk boundary draws what the whole run
    drew (its sampler skips the draws of the resumed tokens); without the skip it repeats the first draws."""
    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine

    engine = Engine(model_dir / "tiny")

    def run(rid: str, max_tokens: int, resume: list[int]) -> tuple[list[tuple[str, list]], object]:
        engine.submit(Submit(rid, max_tokens, prompt=PROMPT, temperature=1.0, seed=7, ignore_eos=True,
                             resume_tokens=resume))
        chunks: list[tuple[str, list]] = []
        while True:
            out, finished = engine.step()
            chunks += [(text, ids) for _, text, _, ids, *_ in out]
            if finished:
                return chunks, finished[0]

    chunks, fin = run("ref", 24, [])
    expected = "".join(t for t, _ in chunks) + fin.text
    for k in (1, len(chunks) // 2, len(chunks) - 1):
        ids = [i for _, chunk_ids in chunks[:k] for i in chunk_ids]
        rest, end = run(f"r{k}", 24 - len(ids), ids)
        assert "".join(t for t, _ in chunks[:k]) + "".join(t for t, _ in rest) + end.text == expected, k

