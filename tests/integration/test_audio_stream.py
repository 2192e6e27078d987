"""Streamed speech end to end: the unmodified openai client's `with_streaming_response` -> gateway -> a Kokoro worker
(make-model's random weights) -> mlx-audio. The worker sends each sentence's bytes as soon as they are encoded, so
the client holds the first bytes while the request is still running: its lease (supervisor state, no heartbeat lag)
is held until the worker's closing Spoken reaches the gateway, and the first bytes are one sentence's, not the
whole. The reference is the same model run in this process (worker/audio_engine.py's `speak_all`): the same samples
within one 16-bit step (pcm, wav), the same encoder's output (mp3: the same bytes; opus: the same decoded samples).
Kokoro speaks about a sentence per 10 s on this CPU: each request here is two or three one-word sentences.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon, wait_for

pytest.importorskip("mlx_audio", reason="the audio extra (mlx-audio, installed with --no-deps) is not installed")
sf = pytest.importorskip("soundfile")

from protocol.messages import Speak  # noqa: E402
from worker.audio_codec import encode_audio  # noqa: E402
from worker.audio_engine import speak_all  # noqa: E402

SENTENCES = ("Hi.", "Yo.", "Ok.")
STEP = 1.5 / 32767  # 16-bit quantisation, nothing else


@pytest.fixture(scope="module")
def speech_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    root = tmp_path_factory.mktemp("speech")
    subprocess.run([*MLXSUP, "make-model", str(root / "kokoro"), "--arch", "kokoro"], check=True, capture_output=True)
    config = root / "config.toml"
    config.write_text(f'[models.kokoro]\npath = "{root / "kokoro"}"\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d, root
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(speech_daemon: tuple[Daemon, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=speech_daemon[0].v1, api_key="x", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def kokoro(speech_daemon: tuple[Daemon, Path]):
    from worker.mlx_engine.audio_models import Kokoro

    return Kokoro(speech_daemon[1] / "kokoro")


@pytest.fixture(scope="module")
def reference(kokoro) -> dict[str, np.ndarray]:
    """Each sentence's samples, spoken in this process (Kokoro seeds its noise per sentence: a sentence speaks the
    same alone or in a text)."""
    return {s: speak_all(kokoro, Speak("ref", s)) for s in SENTENCES}


def text(n: int) -> str:
    return " ".join(SENTENCES[:n])


def whole(reference: dict[str, np.ndarray], n: int) -> np.ndarray:
    return np.concatenate([reference[s] for s in SENTENCES[:n]])


def still_running(d: Daemon) -> bool:
    """The speech request holds its lease: the worker's closing Spoken has not reached the gateway."""
    return d.model("kokoro")["leases"] == 1


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_streamed_audio_starts_before_synthesis_ends_and_is_the_engines_own(
        speech_daemon: tuple[Daemon, Path], client: openai.OpenAI, reference: dict[str, np.ndarray],
        fmt: str) -> None:
    d, _ = speech_daemon
    ref = np.clip(whole(reference, 2), -1, 1)
    received: list[bytes] = []
    with client.audio.speech.with_streaming_response.create(model="kokoro", input=text(2), voice="alloy",
                                                            response_format=fmt, stream_format="audio") as r:
        assert r.headers["content-type"] == {"pcm": "audio/pcm", "wav": "audio/wav"}[fmt]
        assert r.headers["x-audio-sample-rate"] == "24000"
        for chunk in r.iter_bytes():
            if not received:
                running = still_running(d)
            received.append(chunk)
    data = b"".join(received)
    first_sentence = 2 * len(reference[SENTENCES[0]]) + (44 if fmt == "wav" else 0)
    assert running and len(received[0]) <= first_sentence < len(data), (len(received[0]), first_sentence, len(data))
    if fmt == "pcm":
        samples = np.frombuffer(data, "<i2").astype(np.float32) / 32767
    else:
        assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff"  # sizes unknown while streaming
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == 24000
    assert len(samples) == len(ref) and np.max(np.abs(samples - ref)) <= STEP


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_mp3_and_opus_stream_as_one_encoding_of_the_whole(speech_daemon: tuple[Daemon, Path], client: openai.OpenAI,
                                                          reference: dict[str, np.ndarray], fmt: str) -> None:
    d, _ = speech_daemon
    received: list[bytes] = []
    with client.audio.speech.with_streaming_response.create(model="kokoro", input=text(2), voice="alloy",
                                                            response_format=fmt) as r:
        for chunk in r.iter_bytes():
            if not received:
                running = still_running(d)
            received.append(chunk)
    data = b"".join(received)
    assert running and len(received[0]) < len(data)
    at_once = encode_audio(whole(reference, 2), 24000, fmt)
    got, rate = sf.read(io.BytesIO(data), dtype="float32")
    want, _ = sf.read(io.BytesIO(at_once), dtype="float32")
    assert rate == 24000 and len(got) == len(want) >= len(whole(reference, 2))  # mp3: its delay and padding too
    assert np.max(np.abs(got - want)) <= STEP, np.max(np.abs(got - want))
    if fmt == "mp3":
        assert data == at_once  # LAME's frames, whatever the cut into sentences


def test_flac_comes_whole_at_its_end(client: openai.OpenAI, reference: dict[str, np.ndarray]) -> None:
    with client.audio.speech.with_streaming_response.create(model="kokoro", input=text(1), voice="alloy",
                                                            response_format="flac") as r:
        assert r.headers["x-audio-samples"] == str(len(reference[SENTENCES[0]]))
        data = r.read()
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and np.max(np.abs(samples - np.clip(reference[SENTENCES[0]], -1, 1))) <= STEP


def test_sse_events_stream_base64_audio_then_done(speech_daemon: tuple[Daemon, Path], client: openai.OpenAI,
                                                  reference: dict[str, np.ndarray]) -> None:
    d, _ = speech_daemon
    events: list[dict] = []
    with client.audio.speech.with_streaming_response.create(model="kokoro", input=text(2), voice="alloy",
                                                            response_format="pcm", stream_format="sse") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if not events:
                    running = still_running(d)
                events.append(json.loads(line[6:]))
    assert running and [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert events[-1]["usage"] == {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and len(deltas) >= 2
    assert len(deltas[0]) <= 2 * len(reference[SENTENCES[0]])
    samples = np.frombuffer(b"".join(deltas), "<i2").astype(np.float32) / 32767
    ref = np.clip(whole(reference, 2), -1, 1)
    assert len(samples) == len(ref) and np.max(np.abs(samples - ref)) <= STEP


def test_a_client_that_leaves_mid_stream_leaves_the_worker_serving(speech_daemon: tuple[Daemon, Path],
                                                                   client: openai.OpenAI,
                                                                   reference: dict[str, np.ndarray]) -> None:
    """The request is withdrawn: its lease let go, the worker's engine empty, and the same worker answers the next
    request."""
    d, _ = speech_daemon
    pid = d.model("kokoro")["pid"]
    with client.audio.speech.with_streaming_response.create(model="kokoro", input=text(3), voice="alloy",
                                                            response_format="pcm") as r:
        chunks = r.iter_bytes()  # held: a generator dropped closes the response
        first = next(chunks)
        assert first and still_running(d)
    wait_for(lambda: d.model("kokoro")["leases"] == 0, 60, what="the request to be let go")
    wait_for(lambda: d.model("kokoro")["worker_active"] == 0, 60, what="the worker to drop the request")
    after = client.audio.speech.create(model="kokoro", input=text(1), voice="alloy", response_format="pcm")
    samples = np.frombuffer(after.content, "<i2").astype(np.float32) / 32767
    assert np.max(np.abs(samples - np.clip(reference[SENTENCES[0]], -1, 1))) <= STEP
    assert d.model("kokoro")["pid"] == pid
