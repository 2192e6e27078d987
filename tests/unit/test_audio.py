"""Audio models' pure parts (issue 54): kinds from files, the codec's checks and encodings, the engine over fakes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from protocol.messages import INVALID_REQUEST, Embed, Speak, Spoken, SpokenPart, Submit, Transcribe, Transcribed
from protocol.modelkind import CHAT, STT, TTS, model_kind
from worker.audio_codec import SpeechEncoder, check_audio, decode_audio, encode_audio, sniff
from worker.audio_engine import AudioEngine, chunks, shifted, speak_all, transcribe_all
from worker.engine_api import EmbedderApi, RequestRejected


def wav(seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    x = (np.sin(np.arange(int(seconds * rate)) / 7) * 0.3).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, np.stack([x] * channels, axis=1), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_kinds_come_from_the_files(tmp_path: Path) -> None:
    for name, config, kind in [("w", {"model_type": "whisper", "n_mels": 80}, STT),
                               ("h", {"architectures": ["WhisperForConditionalGeneration"]}, STT),
                               ("k", {"istftnet": {}, "plbert": {}, "vocab": {}}, TTS),
                               ("c", {"model_type": "llama"}, CHAT)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert model_kind(tmp_path / name) == kind, name


@pytest.mark.parametrize("data, says", [
    (b"", r"empty \(0 bytes\)"),
    (b"\x00\x00\x00\x18ftypM4A " + b"\x00" * 64, "MP4/M4A"),
    (b"\x1aE\xdf\xa3" + b"\x00" * 64, "WebM"),
    (b"hello, this is text", "not an audio file"),
    (b"RIFF\x10\x00\x00\x00WAVEfmt \x00\x00", "cannot be read"),
    (b"fLaC\x00\x00\x00\x22" + b"\x00" * 10, "cannot be read"),
])
def test_bad_files_are_refused_saying_why(data: bytes, says: str) -> None:
    with pytest.raises(RequestRejected, match=says) as exc:
        decode_audio(data, 16000)
    assert exc.value.code == INVALID_REQUEST


def test_a_truncated_file_and_one_over_the_limit_are_refused() -> None:
    whole = wav(2.0)
    with pytest.raises(RequestRejected):
        decode_audio(whole[:40], 16000)  # the header alone, cut
    with pytest.raises(RequestRejected, match="at most 1s"):
        check_audio(whole, max_audio_s=1.0)
    assert check_audio(whole, max_audio_s=3.0) == ("WAV", 2.0)


def test_the_bytes_decide_the_format_and_audio_is_made_mono_at_the_models_rate() -> None:
    assert sniff(wav()) == "WAV" and sniff(b"OggS....") == "OGG" and sniff(b"ID3\x04") == "MP3"
    samples = decode_audio(wav(1.0, rate=8000, channels=2), 16000)
    assert samples.dtype == np.float32 and samples.ndim == 1 and len(samples) == 16000


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_each_response_format_decodes_back_to_the_length(fmt: str) -> None:
    rate, x = 24000, (np.sin(np.arange(24000) / 5) * 0.5).astype(np.float32)
    data = encode_audio(x, rate, fmt)
    if fmt == "pcm":
        back, back_rate = np.frombuffer(data, "<i2").astype(np.float32) / 32767, rate
    else:
        back, back_rate = sf.read(io.BytesIO(data), dtype="float32")
    seconds = len(back) / back_rate
    assert abs(seconds - 1.0) < 0.1, (fmt, seconds)  # mp3 and opus pad a frame or two
    if fmt in ("wav", "flac", "pcm"):  # lossless but for 16-bit quantisation
        assert np.max(np.abs(back - x)) < 1e-4


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_a_response_encoded_piece_by_piece_is_the_one_encoded_at_once(fmt: str) -> None:
    """The pieces' bytes in order are the response whatever the cut (the stateful encoders see one stream of samples),
    and each format but flac has bytes to send before its end."""
    rate = 24000
    x = (np.sin(np.arange(3 * rate) / 5) * 0.5 * np.linspace(0, 1, 3 * rate)).astype(np.float32)
    encoder = SpeechEncoder(rate, fmt)
    pieces = [encoder.write(x[i:i + 7001]) for i in range(0, len(x), 7001)] + [encoder.close()]
    whole = encode_audio(x, rate, fmt)
    streamed = b"".join(pieces)
    if fmt == "opus":  # an Ogg stream's serial number is drawn at random: the same audio in other bytes
        assert np.array_equal(sf.read(io.BytesIO(streamed))[0], sf.read(io.BytesIO(whole))[0])
    else:
        assert streamed == whole
    early = sum(len(p) for p in pieces[:2])
    assert early == 0 if fmt == "flac" else early > 0, [len(p) for p in pieces]


def test_a_streamed_wav_says_its_sizes_are_unknown_and_reads_to_its_end() -> None:
    data = encode_audio(np.full(100, 0.5, np.float32), 24000, "wav")
    assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff" and len(data) == 44 + 200
    back, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and back.tolist() == [16384] * 100


def test_aac_is_refused_naming_what_is_served() -> None:
    with pytest.raises(RequestRejected, match="no AAC encoder"):
        encode_audio(np.zeros(10), 24000, "aac")


def test_text_is_spoken_a_sentence_at_a_time_within_a_limit() -> None:
    assert chunks("Hello there. How are you?\nFine") == ["Hello there.", "How are you?", "Fine"]
    long = " ".join(["word"] * 300)
    assert all(len(c) <= 400 for c in chunks(long)) and " ".join(chunks(long)) == long


def test_window_segments_are_timed_from_the_files_start() -> None:
    seg = {"id": 0, "start": 1.0, "end": 2.5, "text": " a", "words": [{"word": " a", "start": 1.0, "end": 1.5}]}
    out = shifted([seg], 30.0, 4)
    assert out[0]["id"] == 4 and out[0]["start"] == 31.0 and out[0]["words"][0]["end"] == 31.5


class FakeWhisper:
    rate = 16000
    window_s = 1.0

    def __init__(self) -> None:
        self.prompts: list[str | None] = []

    def transcribe(self, samples, task, language, prompt, temperature, words) -> dict:
        self.prompts.append(prompt)
        text = f" {len(samples)}"
        return {"text": text, "language": language or "en",
                "segments": [{"id": 0, "start": 0.0, "end": len(samples) / self.rate, "text": text}]}


class FakeKokoro:
    rate = 24000
    voices = ["af_heart", "am_adam"]

    def __init__(self) -> None:
        self.spoken: list[str] = []

    def speak(self, text, voice, speed):
        self.spoken.append(text)
        return np.full(int(len(text) * 100 / speed), 0.25, np.float32) * (1 + len(self.spoken) % 3)


def run(engine: AudioEngine, msg, parts: list[SpokenPart] | None = None) -> Transcribed | Spoken:
    """The request's reply, its parts (SpokenPart) gathered in `parts` on the way."""
    engine.enqueue(msg)
    for _ in range(1000):
        for reply in engine.embed_step():
            if isinstance(reply, SpokenPart):
                assert parts is not None, reply
                parts.append(reply)
                continue
            assert len(engine) == 0
            return reply
    raise AssertionError("no reply")


def test_long_audio_is_transcribed_window_by_window_each_conditioned_on_the_text_before() -> None:
    model = FakeWhisper()
    engine = AudioEngine(model, speaks=False)
    assert isinstance(engine, EmbedderApi)
    reply = run(engine, Transcribe("r1", wav(2.5), prompt="Names: Ada."))
    assert isinstance(reply, Transcribed) and reply.code is None
    assert reply.text == " 16000 16000 8000" and reply.duration == 2.5
    assert [s["start"] for s in reply.segments] == [0.0, 1.0, 2.0] and [s["id"] for s in reply.segments] == [0, 1, 2]
    assert model.prompts == ["Names: Ada.", " 16000", " 16000 16000"]
    assert transcribe_all(FakeWhisper(), decode_audio(wav(2.5), 16000), Transcribe("r", b"")) == \
        Transcribed("r", reply.text, reply.language, reply.duration, reply.segments)


def test_speech_is_encoded_as_asked() -> None:
    engine = AudioEngine(FakeKokoro(), speaks=True)
    parts: list[SpokenPart] = []
    reply = run(engine, Speak("s1", "Hi there. Bye.", "am_adam", 2.0, "wav"), parts)
    assert isinstance(reply, Spoken) and reply.code is None and reply.sample_rate == 24000
    assert reply.samples == (9 + 4) * 50
    assert len(sf.read(io.BytesIO(b"".join(p.audio for p in parts) + reply.audio))[0]) == reply.samples


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "flac"])
def test_speech_streams_each_sentence_before_the_next_is_spoken(fmt: str) -> None:
    """Catches: parts held back to the end, or a sentence spoken before the last one's bytes were sent (the first
    bytes would wait for the second sentence). The parts and the reply are the whole speech encoded at once."""
    model = FakeKokoro()
    engine = AudioEngine(model, speaks=True)
    msg = Speak("s1", "One. Two two. Three three three.", response_format=fmt)
    engine.enqueue(msg)
    sent: list[tuple[int, SpokenPart | Spoken]] = []  # (sentences spoken when it was sent, what)
    while not sent or not isinstance(sent[-1][1], Spoken):
        sent += [(len(model.spoken), r) for r in engine.embed_step()]
    parts = [(n, r) for n, r in sent if isinstance(r, SpokenPart)]
    whole = encode_audio(speak_all(FakeKokoro(), msg), 24000, fmt)
    assert b"".join(r.audio for _, r in sent) == whole and len(engine) == 0
    if fmt == "flac":  # written whole at its end
        assert parts == []
    else:
        assert [n for n, _ in parts] == [1, 2, 3] and all(r.sample_rate == 24000 for _, r in parts)


def test_speech_withdrawn_mid_stream_is_answered_once_and_sends_nothing_more() -> None:
    engine = AudioEngine(FakeKokoro(), speaks=True)
    engine.enqueue(Speak("s1", "One. Two. Three.", response_format="mp3"))
    while not (out := engine.embed_step()):
        pass
    assert isinstance(out[0], SpokenPart)
    gone = engine.withdraw("s1", "aborted", "the request was aborted")
    assert isinstance(gone, Spoken) and gone.code == "aborted" and len(engine) == 0 and engine.rids == []
    engine.encodes.wait(5.0)
    assert engine.embed_step() == [] and engine.withdraw("s1", "aborted", "") is None


def test_an_encoder_that_fails_fails_its_request_alone() -> None:
    engine = AudioEngine(FakeKokoro(), speaks=True)
    engine.enqueue(Speak("bad", "One. Two.", response_format="pcm"))
    engine.jobs[0].encoder.write = lambda samples: 1 / 0  # type: ignore[method-assign, union-attr]
    replies: list = []
    while not any(isinstance(r, Spoken) for r in replies):
        replies += engine.embed_step()
    assert [(type(r), r.code) for r in replies] == [(Spoken, "internal_error")] and "encoded" in replies[0].message
    assert isinstance(run(engine, Speak("good", "Hi.", response_format="pcm"), []), Spoken)


@pytest.mark.parametrize("msg, says", [
    (Speak("s", "   "), "input is empty"),
    (Speak("s", "x" * 5000), "at most 4096"),
    (Speak("s", "hi", voice="alloy"), "voice 'alloy' is not one of"),
    (Speak("s", "hi", speed=9.0), "speed must be between"),
    (Speak("s", "hi", response_format="aac"), "no AAC encoder"),
    (Transcribe("t", wav()), "text-to-speech model"),
    (Embed("e", ["x"]), "text-to-speech model"),
])
def test_bad_requests_are_refused_before_any_work(msg, says: str) -> None:
    engine = AudioEngine(FakeKokoro(), speaks=True)
    with pytest.raises(RequestRejected, match=says):
        engine.enqueue(msg)
    assert len(engine) == 0
    with pytest.raises(RequestRejected, match="not chat or completions"):
        engine.submit(Submit("c", 4, prompt="hi"))


def test_a_bad_file_is_refused_at_once_and_an_abort_answers_with_its_code() -> None:
    engine = AudioEngine(FakeWhisper(), speaks=False)
    with pytest.raises(RequestRejected, match="empty"):
        engine.enqueue(Transcribe("t0", b""))
    engine.enqueue(Transcribe("t1", wav(3.0)))
    assert engine.rids == ["t1"]
    gone = engine.withdraw("t1", "aborted", "the request was aborted")
    assert gone is not None and gone.code == "aborted" and len(engine) == 0
    engine.enqueue(Transcribe("t2", wav(3.0)))
    failed = engine.fail_all("worker_crashed", "boom")
    assert [(r.rid, r.code) for r in failed] == [("t2", "worker_crashed")] and len(engine) == 0


def test_settle_drops_the_model_and_the_generation_side_stays_empty() -> None:
    released: list[int] = []
    engine = AudioEngine(FakeWhisper(), speaks=False, release=lambda: released.append(1))
    assert engine.step() == ([], []) and engine.plan_step().predicted_s == 0.0 and not engine.warm_step()
    assert engine.settle() > 0 and engine.model is None and released == [1]


def test_audio_repos_can_be_pulled_with_their_voice_packs() -> None:
    from supervisor.hub.arch import unsupported
    from supervisor.hub.pull import wanted

    assert unsupported({"model_type": "whisper", "n_mels": 80}) is None
    assert unsupported({"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"}) is None
    assert unsupported({"istftnet": {}, "plbert": {}, "vocab": {}}) is None
    assert wanted("voices/af_heart.safetensors") and not wanted("voices/af_heart.pt")
    assert wanted("preprocessor_config.json") and wanted("merges.txt") and not wanted("samples/a.wav")
