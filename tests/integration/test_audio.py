"""/v1/audio end to end (issue 54): the unmodified openai client -> gateway -> a Whisper worker (stt) and a Kokoro worker
(tts) -> mlx-audio, beside a chat model in one daemon. The models are make-model's random-weight Whisper and Kokoro
(small and fast; the real ones, converted from the CTranslate2 and ONNX files that wheels ship, are
tests/integration/test_audio_real.py's), so the reference is the same code run in this process: worker/audio_engine.py's `transcribe_all` over
worker/mlx_engine/audio_models.py's Whisper (same text, same segments and words: exactly, greedy decoding being
deterministic), and its Kokoro (same samples within one 16-bit step, the wire format's quantisation). Whisper's
windows are capped at 8 tokens (--max-window-tokens: random weights never stop by themselves); Kokoro synthesises
slowly on a CPU (about 13 s for a short word here), so speech is asked for three times.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import MLXSUP, Daemon, make_model, start_daemon, wait_for

pytest.importorskip("mlx_audio", reason="the audio extra (mlx-audio, installed with --no-deps) is not installed")
sf = pytest.importorskip("soundfile")

from protocol.messages import Transcribe  # noqa: E402
from worker.audio_codec import decode_audio, encode_audio  # noqa: E402
from worker.audio_engine import transcribe_all  # noqa: E402

MAX_BYTES = 3_000_000  # the daemon's [server] audio_max_bytes here
MAX_AUDIO_S = 70.0
WINDOW_TOKENS = 8


def tone(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, x, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module")
def audio_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    root = tmp_path_factory.mktemp("audio")
    for arch in ("whisper", "kokoro"):
        subprocess.run([*MLXSUP, "make-model", str(root / arch), "--arch", arch], check=True, capture_output=True)
    make_model(root / "tiny")
    config = root / "config.toml"
    config.write_text(f'[server]\naudio_max_bytes = {MAX_BYTES}\nmax_audio_s = {MAX_AUDIO_S}\n\n'
                      f'[models.whisper]\npath = "{root / "whisper"}"\n'
                      f'worker_args = ["--max-window-tokens", "{WINDOW_TOKENS}"]\n\n'
                      f'[models.kokoro]\npath = "{root / "kokoro"}"\n\n[models.tiny]\npath = "{root / "tiny"}"\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d, root
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(audio_daemon: tuple[Daemon, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=audio_daemon[0].v1, api_key="x", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def whisper(audio_daemon: tuple[Daemon, Path]):
    from worker.mlx_engine.audio_models import Whisper

    return Whisper(audio_daemon[1] / "whisper", WINDOW_TOKENS)


def reference(whisper, audio: bytes, **fields) -> dict:
    reply = transcribe_all(whisper, decode_audio(audio, 16000), Transcribe("ref", audio, **fields))
    return {"text": reply.text, "language": reply.language, "segments": reply.segments}


def test_audio_models_are_listed_with_their_kinds(audio_daemon: tuple[Daemon, Path], client: openai.OpenAI) -> None:
    d, _ = audio_daemon
    kinds = {m["id"]: m["kind"] for m in d.status()["models"]}
    assert kinds["whisper"] == "stt" and kinds["kokoro"] == "tts" and kinds["tiny"] == "chat"
    assert {"whisper", "kokoro", "tiny"} <= {m.id for m in client.models.list().data}


def test_transcription_in_every_format_is_the_engines_own(client: openai.OpenAI, whisper) -> None:
    audio = tone(1.5)
    ref = reference(whisper, audio, language="en")
    words = reference(whisper, audio, language="en", words=True)
    assert ref["segments"] and words["segments"][0]["words"]  # word timestamps seek by words: their own text
    got = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio, "audio/wav"), language="en")
    assert got.text == ref["text"]
    text = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), language="en",
                                              response_format="text")
    assert text == ref["text"]
    srt = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), language="en",
                                             response_format="srt")
    assert srt.startswith("1\n00:00:") and " --> " in srt and ref["segments"][0]["text"].strip() in srt
    vtt = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), language="en",
                                             response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:") and vtt.count(" --> ") == len(ref["segments"])
    verbose = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), language="en",
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"])
    assert verbose.text == words["text"] and verbose.language == "english" and verbose.duration == 1.5
    assert [(s.start, s.end, s.text) for s in verbose.segments] == \
        [(s["start"], s["end"], s["text"]) for s in words["segments"]]
    assert [(w.word, w.start, w.end) for w in verbose.words] == \
        [(w["word"].strip(), w["start"], w["end"]) for s in words["segments"] for w in s["words"]]


def test_a_streamed_transcription_and_a_translation(client: openai.OpenAI, whisper) -> None:
    audio = tone(1.0)
    ref = reference(whisper, audio, language="en")
    events = list(client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), language="en",
                                                     stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done" and events[-1].text == ref["text"]
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == ref["text"]
    translated = client.audio.translations.create(model="whisper", file=("a.wav", audio))
    assert translated.text == reference(whisper, audio, task="translate")["text"]


def test_speech_whole_and_streamed_is_the_engines_own(audio_daemon: tuple[Daemon, Path],
                                                       client: openai.OpenAI) -> None:
    from worker.mlx_engine.audio_models import Kokoro

    kokoro = Kokoro(audio_daemon[1] / "kokoro")
    ref = kokoro.speak("Hi.", kokoro.voices[0], 1.0)
    whole = client.audio.speech.create(model="kokoro", input="Hi.", voice="alloy", response_format="wav")
    samples, rate = sf.read(io.BytesIO(whole.content), dtype="float32")
    assert rate == kokoro.rate == 24000 and len(samples) == len(ref) > 0
    assert np.max(np.abs(samples - np.clip(ref, -1, 1))) <= 1.5 / 32767  # 16-bit quantisation, nothing else
    with client.audio.speech.with_streaming_response.create(model="kokoro", input="Hi.", voice="alloy",
                                                            response_format="mp3") as streamed:
        assert streamed.headers["content-type"] == "audio/mpeg"
        mp3 = b"".join(streamed.iter_bytes())
    decoded, mp3_rate = sf.read(io.BytesIO(mp3), dtype="float32")
    at_once, _ = sf.read(io.BytesIO(encode_audio(ref, kokoro.rate, "mp3")), dtype="float32")
    assert mp3_rate == 24000 and len(decoded) == len(at_once) > len(ref)  # LAME's delay and padding, not trimmed
    assert np.max(np.abs(decoded - at_once)) <= 1.5 / 32767
    events = []
    with httpx.stream("POST", audio_daemon[0].v1 + "/audio/speech", timeout=600,
                      json={"model": "kokoro", "input": "Hi.", "response_format": "pcm", "stream_format": "sse"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done" and len(pcm) == 2 * len(ref)


@pytest.mark.parametrize("case", ["empty", "truncated", "lying_type", "mp4", "over_length", "over_size"])
def test_a_bad_file_is_a_400_and_the_worker_lives(audio_daemon: tuple[Daemon, Path], client: openai.OpenAI,
                                                  case: str) -> None:
    d, _ = audio_daemon
    client.audio.transcriptions.create(model="whisper", file=("a.wav", tone(0.5)), language="en")
    pid = d.model("whisper")["pid"]
    data, name, ctype = {
        "empty": (b"", "a.wav", "audio/wav"),
        "truncated": (tone(1.0)[:30], "a.wav", "audio/wav"),
        "lying_type": (b"this is not audio at all" * 10, "a.mp3", "audio/mpeg"),
        "mp4": (b"\x00\x00\x00\x18ftypM4A " + b"\x00" * 100, "a.m4a", "audio/mp4"),
        "over_length": (tone(MAX_AUDIO_S + 1, rate=8000), "a.wav", "audio/wav"),
        "over_size": (b"RIFF" + b"\x00" * MAX_BYTES, "a.wav", "audio/wav"),
    }[case]
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.transcriptions.create(model="whisper", file=(name, data, ctype))
    body = exc.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["message"], body
    assert d.model("whisper")["pid"] == pid


@pytest.mark.parametrize("fields, says", [
    ({"input": ""}, "input"),
    ({"input": "x" * 5000}, "at most 4096"),
    ({"voice": "nobody"}, "voice 'nobody'"),
    ({"response_format": "aac"}, "no AAC encoder"),
    ({"speed": 9}, "speed"),
    ({"model": "whisper"}, "text-to-speech"),
    ({"model": "tiny"}, "text-to-speech"),
])
def test_bad_speech_requests_are_400s(audio_daemon: tuple[Daemon, Path], fields: dict, says: str) -> None:
    r = httpx.post(audio_daemon[0].v1 + "/audio/speech", timeout=600,
                   json={"model": "kokoro", "input": "Hi.", "voice": "af_heart", **fields})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_models_of_other_kinds_are_refused_on_each_route(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="speech-to-text"):
        client.audio.transcriptions.create(model="tiny", file=("a.wav", tone(0.5)))
    with pytest.raises(openai.BadRequestError, match="speech-to-text model"):
        client.chat.completions.create(model="whisper", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_worker_killed_mid_transcription_is_a_clean_error_and_a_fresh_worker_answers_next(
        audio_daemon: tuple[Daemon, Path], client: openai.OpenAI) -> None:
    """Last in the file: it kills the module's Whisper worker. Word timestamps over three windows keep it busy for
    seconds (a random-weight model's words come a few frames apart), long enough to be caught working."""
    d, _ = audio_daemon
    client.audio.transcriptions.create(model="whisper", file=("a.wav", tone(0.5)), language="en")
    pid = d.model("whisper")["pid"]
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["reply"] = client.audio.transcriptions.create(
                model="whisper", file=("long.wav", tone(65, rate=8000)), language="en",
                response_format="verbose_json", timestamp_granularities=["word"])
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: d.model("whisper")["worker_active"] > 0, 60, what="the worker to be transcribing")
    os.kill(pid, signal.SIGKILL)
    asking.join(120)
    assert not asking.is_alive() and "reply" not in outcome
    error = outcome["error"]
    assert error.status_code == 502 and error.body["code"] == "worker_crashed", error.body
    after = client.audio.transcriptions.create(model="whisper", file=("a.wav", tone(0.5)), language="en")
    assert isinstance(after.text, str)
    assert d.model("whisper")["pid"] not in (None, pid) and d.model("whisper")["crashes"] >= 1


def test_chat_an_embedder_stt_and_tts_under_a_ceiling_for_one_take_turns(audio_daemon: tuple[Daemon, Path],
                                                                          daemon_factory) -> None:
    """Every kind in one daemon under a memory ceiling that holds the Kokoro worker alone: the audio workers are
    evicted for the others (admission) and every request is answered; status names every kind. (The chat model and
    the embedder, a few MB each, may share the room with Whisper: which ones go is admission's measure, not fixed.)"""
    d, root = audio_daemon
    subprocess.run([*MLXSUP, "make-model", str(root / "bert"), "--arch", "bert"], check=True, capture_output=True)
    for m in ("whisper", "kokoro"):
        assert httpx.post(f"{d.url}/api/models/{m}/load", json={}, timeout=600).status_code == 200
    footprint = max(d.model(m)["memory_bytes"] for m in ("whisper", "kokoro"))
    weights = max(d.model(m)["weights_bytes"] for m in ("whisper", "kokoro", "tiny"))
    config = root / "one.toml"
    config.write_text(f'[memory]\nceiling = {weights + footprint + 16 * 2**20}\nworker_overhead = {footprint}\n\n'
                      f'[models.whisper]\npath = "{root / "whisper"}"\n'
                      f'worker_args = ["--max-window-tokens", "{WINDOW_TOKENS}"]\n\n'
                      f'[models.kokoro]\npath = "{root / "kokoro"}"\n\n[models.tiny]\npath = "{root / "tiny"}"\n\n'
                      f'[models.bert]\npath = "{root / "bert"}"\n')
    one = daemon_factory("--config", str(config), name="one")
    c = openai.OpenAI(base_url=one.v1, api_key="x", timeout=600, max_retries=0)
    assert {m["id"]: m["kind"] for m in one.status()["models"]} == \
        {"whisper": "stt", "kokoro": "tts", "tiny": "chat", "bert": "embedding"}
    asks = [lambda: c.audio.transcriptions.create(model="whisper", file=("a.wav", tone(0.5)), language="en").text,
            lambda: len(c.audio.speech.create(model="kokoro", input="Hi.", voice="alloy", response_format="wav").content),
            lambda: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2).choices[0].finish_reason,
            lambda: len(c.embeddings.create(model="bert", input="hello").data[0].embedding),
            lambda: c.audio.transcriptions.create(model="whisper", file=("a.wav", tone(0.5)), language="en").text]
    answers = [ask() for ask in asks]
    assert all(a is not None for a in answers) and answers[1] > 44 and answers[3] > 0
    evicted = [e["model"] for e in one.status()["recent_evictions"] if e["reason"] == "admission"]
    assert {"whisper", "kokoro"} <= set(evicted), evicted
    ready = [m["id"] for m in one.status()["models"] if m["state"] == "ready"]
    assert "whisper" in ready and "kokoro" not in ready, ready
