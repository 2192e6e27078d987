"""A batch's text made on a thread of its own, a step later (worker/text_thread.py, issue 30).

The thread alone, then the product's Engine on the tiny model (real MLX on the CPU, no sockets): with the text
thread, every request's text, ids, finish reason and usage are what they are without it, through a stop string
found a step late, logprobs (kept on the main thread) and an abort while its row's text is being made.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from protocol.messages import Submit
from tests.unit.test_request_output import PIECES, Detok
from worker.mlx_engine.engine import Engine
from worker.output_parser import PlainParser
from worker.request_output import RequestOutput
from worker.text_thread import TextThread, make_text
from worker.textstream import TextStream

LONG = [(i * 7919) % 1000 + 3 for i in range(40)]
OTHER = [5, 9, 17, 33, 2, 41, 8]


def plain(stop: list[str] | None = None) -> RequestOutput:
    return RequestOutput(TextStream(Detok(), stop or []), PlainParser())


def test_the_thread_makes_what_the_caller_would_and_a_stop_ends_a_rows_pushes() -> None:
    tokens = [4, 5, 6, 7]  # "Ok", "<tool_call>", '\n{"name": "f", ', ...
    text = TextThread()
    try:
        text.start([(plain(), tokens), (plain(stop=["tool"]), tokens), (plain(), [0])])
        got = text.collect()
        assert got == make_text([(plain(), tokens), (plain(stop=["tool"]), tokens), (plain(), [0])])
        assert got[0] == (["".join(PIECES[t] for t in tokens), 4], 4, False)
        assert got[1] == (None, 2, True)  # the stop string came with the second token: two pushed, no chunk taken
        assert text._thread is not None and text._thread.name == "mlxsup-text"
    finally:
        text.close()


def test_a_push_that_raises_is_raised_by_collect_and_close_ends_the_thread() -> None:
    text = TextThread()
    text.start([(plain(), [len(PIECES)])])  # no such piece: the detokenizer raises
    with pytest.raises(IndexError):
        text.collect()
    thread = text._thread
    text.start([(plain(), [4])])
    text.close()  # a job in flight: finished, its result dropped
    assert thread is not None and not thread.is_alive()
    text.start([(plain(), [0])])  # a new thread; no stale result
    assert text.collect() == [(["<think>", 1], 1, False)]
    text.close()
    assert text._thread is None and not any(t.name == "mlxsup-text" for t in threading.enumerate())


def test_close_does_not_wait_past_its_timeout_for_a_job_that_hangs() -> None:
    release = threading.Event()

    class Stuck(Detok):
        def add_token(self, token: int) -> None:
            release.wait(30)
            super().add_token(token)

    text = TextThread()
    text.start([(RequestOutput(TextStream(Stuck(), []), PlainParser()), [0])])
    thread = text._thread
    closer = threading.Thread(target=text.close, kwargs={"timeout_s": 0.1})
    closer.start()
    closer.join(10)
    try:
        assert not closer.is_alive()  # close returned; the stuck job's thread is left to the exit
        assert thread is not None and thread.is_alive() and text._thread is None
        # a new job after it gets a thread of its own, and its own result (the stuck thread does not take it)
        text.start([(plain(), [0])])
        got: list = []
        collector = threading.Thread(target=lambda: got.append(text.collect()))
        collector.start()
        collector.join(10)
        assert got == [[(["<think>", 1], 1, False)]] and text._thread is not thread
        text.close()
    finally:
        release.set()
        assert thread is not None
        thread.join(10)
    assert not thread.is_alive()


def run(engine: Engine, submits: list[Submit], abort: str | None = None) -> dict:
    """Step until idle; per request its text, ids, chunks' logprobs and Finished; `abort`: that request is aborted at
    the first step after which its last tokens wait for the text thread (how many steps its prefill takes depends on
    the machine's measured speed)."""
    for msg in submits:
        engine.submit(msg)
    got: dict[str, dict] = {m.rid: {"text": "", "ids": [], "logprobs": [], "end": None} for m in submits}
    steps = 0
    while len(engine):
        chunks, finished = engine.step()
        steps += 1
        for chunk in chunks:
            g = got[chunk[0]]
            assert g["end"] is None, "a chunk after its request's end"
            g["text"] += chunk[1]
            g["ids"] += chunk[3]
            g["logprobs"] += (chunk[4] if len(chunk) > 4 else {}).get("logprobs", [])
        for f in finished:
            g = got[f.rid]
            g["text"] += f.text
            g["ids"] += f.token_ids
            g["logprobs"] += (f.extra or {}).get("logprobs", [])
            g["end"] = (f.finish_reason, f.completion_tokens, f.prompt_tokens)
        if abort is not None and abort in [req.rid for req, _ in engine.output.lagged]:
            assert engine.abort(abort)
            abort = None
        assert steps < 200
    assert abort is None, "its tokens never waited for the text thread"
    return got


def test_with_the_text_thread_every_request_says_and_counts_what_it_does_without(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync = Engine(model_dir / "tiny", solo="off")
    first = run(sync, [Submit(rid="probe", max_tokens=12, prompt_ids=OTHER, temperature=0.0)])["probe"]
    text = first["text"]  # a stop string first met mid-reply: the generator would go on past it
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text.find(text[i:i + 3]) == i)
    assert first["end"][0] == "length"
    submits = [Submit(rid="long", max_tokens=10, prompt_ids=LONG, temperature=0.0),
               Submit(rid="stop", max_tokens=12, prompt_ids=OTHER, temperature=0.0, stop=[stop]),
               Submit(rid="lp", max_tokens=6, prompt_ids=OTHER[:5], temperature=0.0, logprobs=2)]
    want = run(sync, submits)
    assert want["stop"]["end"][0] == "stop" and 3 < want["stop"]["end"][1] < 12 and len(want["lp"]["logprobs"]) == 6

    threads: dict[tuple[str, str], int] = {}
    push = RequestOutput.push

    def spy(self: RequestOutput, token: int, logprobs: object = None) -> None:
        key = ("lp" if self._logprobs is not None else "plain", threading.current_thread().name)
        threads[key] = threads.get(key, 0) + 1
        push(self, token, logprobs)

    monkeypatch.setattr(RequestOutput, "push", spy)
    lagged = Engine(model_dir / "tiny", solo="off", text_thread=True)
    try:
        assert run(lagged, submits) == want
        # on the main thread: logprobs (they read MLX arrays), a reply's first token, and its last where the generator
        # ended it (the "long" row's)
        assert threads == {("plain", "mlxsup-text"): 10 - 2 + want["stop"]["end"][1] - 1, ("plain", "MainThread"): 3,
                           ("lp", "MainThread"): 6}
        assert lagged.generated_tokens == sync.generated_tokens - len(first["ids"])
    finally:
        lagged.settle()
    assert lagged.output.text is not None and lagged.output.text._thread is None


def test_a_row_aborted_while_its_text_is_made_says_nothing_more_and_the_batch_goes_on(model_dir: Path) -> None:
    submits = [Submit(rid="a", max_tokens=8, prompt_ids=LONG, temperature=0.0),
               Submit(rid="b", max_tokens=8, prompt_ids=OTHER, temperature=0.0)]
    want = run(Engine(model_dir / "tiny", solo="off"), submits)
    engine = Engine(model_dir / "tiny", solo="off", text_thread=True)
    try:
        got = run(engine, submits, abort="a")
        assert got["b"] == want["b"]
        assert got["a"]["end"] is None and got["a"]["ids"] == want["a"]["ids"][:len(got["a"]["ids"])]
        assert not engine.output.making and not engine.output.lagged and len(engine) == 0
    finally:
        engine.settle()
