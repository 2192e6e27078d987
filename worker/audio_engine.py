"""The engine of an audio model: speech to text (Transcribe) or text to speech (Speak), one piece of work
per loop turn; no MLX here (the models are worker/mlx_engine/audio_models.py's), so tests drive it with fakes.

worker/loop.py drives it as its EngineApi (a generation batch that stays empty: chat is refused, saying what this
model serves) and as an EmbedderApi: `enqueue` checks a request on the loop's thread (an audio file's header only:
worker/audio_codec.py's `check_audio`; a text's length, its voice, its speed, its format) and starts its file's
decoding on a thread of worker/image_decode.py's `Decodes`, with a deadline, so no decoding ever runs on the loop's
thread; `embed_step` (once per loop turn while requests are pending) takes the decodes that ended and runs one
piece of model work: one 30-second window of one transcription (long audio is transcribed window by window, each
conditioned on the text before it, so a turn's work and the model's memory are bounded by a window, and the
loop's heartbeat comes between windows), or one chunk of text of one synthesis (Kokoro's window is 510
phonemes: text is spoken a sentence at a time). `withdraw` answers an Abort.

Invariants: every enqueued request is answered exactly once (Transcribed or Spoken: its result, or a code); a
model error fails that request alone (INTERNAL_ERROR) and the engine goes on.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.messages import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    Message,
    Speak,
    Spoken,
    Submit,
    Transcribe,
    Transcribed,
)
from worker.audio_codec import RESPONSE_FORMATS, check_audio, decode_audio, encode_audio
from worker.embedding_engine import EmbeddingEngine
from worker.engine_api import PromptCacheApi, RequestRejected
from worker.image_decode import DECODE_DEADLINE_S, Decodes

log = logging.getLogger(__name__)

Reply = Transcribed | Spoken
TASKS = ("transcribe", "translate")
MAX_INPUT_CHARS = 4096  # OpenAI's limit on /v1/audio/speech's input
SPEEDS = (0.25, 4.0)
IDLE_WAIT_S = 0.05  # with only decodes in flight, a turn waits this long for one to end (not a busy loop)
SENTENCE = re.compile(r"(?<=[.!?;:])\s+|\n+")


class Transcriber(Protocol):
    """A speech-to-text model: `rate` Hz mono input, transcribed `window_s` seconds at a time."""

    rate: int
    window_s: float

    def transcribe(self, samples: Any, task: str, language: str | None, prompt: str | None, temperature: float,
                   words: bool) -> dict:
        """One window: {"text", "language", "segments": [...]} (times from the window's start)."""
        ...


class Speaker(Protocol):
    """A text-to-speech model: float samples at `rate` Hz for a chunk of text."""

    rate: int
    voices: list[str]  # the first is the default

    def speak(self, text: str, voice: str, speed: float) -> Any: ...


def chunks(text: str, limit: int = 400) -> list[str]:
    """The text a sentence at a time, each at most `limit` characters (a longer sentence is cut at spaces)."""
    pieces: list[str] = []
    for sentence in (s.strip() for s in SENTENCE.split(text)):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            pieces.append(sentence[:cut])
            sentence = sentence[cut:].strip()
        if sentence:
            pieces.append(sentence)
    return pieces


def shifted(segments: list[dict], offset_s: float, first_id: int) -> list[dict]:
    """A window's segments with their times (and their words') from the file's start, numbered on from `first_id`."""
    out = []
    for i, seg in enumerate(segments):
        seg = {**seg, "id": first_id + i, "start": round(seg["start"] + offset_s, 3),
               "end": round(seg["end"] + offset_s, 3)}
        if "words" in seg:
            seg["words"] = [{**w, "start": round(w["start"] + offset_s, 3), "end": round(w["end"] + offset_s, 3)}
                            for w in seg["words"]]
        out.append(seg)
    return out


def transcribe_all(model: Transcriber, samples: Any, msg: Transcribe) -> Reply:
    """The whole file window by window, as the engine does it over several turns: the in-process reference."""
    job = Job(msg, samples)
    while not job.step(model):
        pass
    return job.reply()


@dataclass
class Job:
    """One request past its decode: its samples (a transcription) or its text chunks (a synthesis), and the results
    of the windows or chunks done."""

    msg: Transcribe | Speak
    samples: Any = None
    pieces: list[str] = field(default_factory=list)
    at: int = 0  # the next window or chunk
    text: list[str] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)
    language: str = ""
    audio: list[Any] = field(default_factory=list)
    rate: int = 0

    def step(self, model: Any) -> bool:
        """Run the next window or chunk; True once none is left."""
        if isinstance(self.msg, Speak):
            self.rate = model.rate
            self.audio.append(model.speak(self.pieces[self.at], self.msg.voice or model.voices[0], self.msg.speed))
            self.at += 1
            return self.at >= len(self.pieces)
        m: Transcriber = model
        width = int(m.rate * m.window_s)
        window = self.samples[self.at * width:(self.at + 1) * width]
        prompt = self.msg.prompt if self.at == 0 else "".join(self.text)[-200:] or None
        out = m.transcribe(window, self.msg.task, self.msg.language or (self.language or None), prompt,
                           self.msg.temperature, self.msg.words)
        self.language = self.language or out.get("language") or ""
        self.text.append(out["text"])
        self.segments += shifted(out.get("segments") or [], self.at * m.window_s, len(self.segments))
        self.at += 1
        self.rate = m.rate
        return self.at * width >= len(self.samples)

    def reply(self) -> Reply:
        if isinstance(self.msg, Speak):
            import numpy as np

            samples = np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)
            return Spoken(self.msg.rid, encode_audio(samples, self.rate, self.msg.response_format), self.rate,
                          len(samples))
        return Transcribed(self.msg.rid, "".join(self.text), self.language, round(len(self.samples) / self.rate, 3),
                           self.segments)


def refusal(msg: Transcribe | Speak, code: str, message: str) -> Reply:
    return Transcribed(msg.rid, code=code, message=message) if isinstance(msg, Transcribe) else \
        Spoken(msg.rid, code=code, message=message)


class AudioEngine:
    """worker/engine_api.py's EngineApi (no generation batch) and EmbedderApi, over a Transcriber or a Speaker."""

    def __init__(self, model: Transcriber | Speaker, *, speaks: bool, weights_bytes: int = 0, load_s: float = 0.0,
                 decode_deadline_s: float = DECODE_DEADLINE_S, max_input_chars: int = MAX_INPUT_CHARS,
                 release: Callable[[], None] = lambda: None,
                 unload: Callable[[Callable[[], None]], object] = lambda drop: drop()) -> None:
        self.model = model
        self.speaks = speaks
        self.release = release
        self.unload = unload
        self.decodes = Decodes(decode_deadline_s, what="audio file")
        self.jobs: list[Job] = []
        self.max_input_chars = max_input_chars
        self.context_length = 0
        self.vocab_size = 0
        self.weights_bytes = weights_bytes
        self.load_s = load_s
        self.drafting, self.priced = "", False
        self.generated_tokens = 0
        self.peak_batch_size = 0
        self.prefill_batch_size = 1

    # --- EmbedderApi -------------------------------------------------------------------------

    def enqueue(self, msg: Message) -> None:
        """Check a request and start its work; RequestRejected for a bad one (nothing is started)."""
        if isinstance(msg, Speak) and self.speaks:
            self.jobs.append(Job(msg, pieces=self._pieces(msg)))
        elif isinstance(msg, Transcribe) and not self.speaks:
            if msg.task not in TASKS:
                raise RequestRejected(INVALID_REQUEST, f"task must be one of {', '.join(TASKS)}")
            check_audio(msg.audio, msg.max_audio_s)  # the header only: cheap, and a bad file is refused at once
            rate, data, limit = self.model.rate, msg.audio, msg.max_audio_s
            self.decodes.start(msg.rid, lambda _: decode_audio(data, rate, limit), msg)
        else:
            raise RequestRejected(INVALID_REQUEST, self._serves(msg))

    def _pieces(self, msg: Speak) -> list[str]:
        model: Speaker = self.model  # type: ignore[assignment]  # self.speaks
        if not msg.input.strip():
            raise RequestRejected(INVALID_REQUEST, "input is empty: there is nothing to speak")
        if len(msg.input) > self.max_input_chars:
            raise RequestRejected(INVALID_REQUEST, f"input has {len(msg.input)} characters; this model speaks at "
                                                   f"most {self.max_input_chars} per request")
        if msg.voice is not None and msg.voice not in model.voices:
            raise RequestRejected(INVALID_REQUEST, f"voice '{msg.voice}' is not one of this model's: "
                                                   f"{', '.join(model.voices)}")
        if not SPEEDS[0] <= msg.speed <= SPEEDS[1]:
            raise RequestRejected(INVALID_REQUEST, f"speed must be between {SPEEDS[0]} and {SPEEDS[1]}")
        if msg.response_format not in RESPONSE_FORMATS:
            encode_audio([], model.rate, msg.response_format)  # raises, saying why (aac: no encoder)
        return chunks(msg.input)

    def embed_step(self) -> list[Reply]:
        """Take the ended decodes, then run one window or chunk of the oldest job; the replies of those done."""
        replies: list[Reply] = []
        for payload, outcome in self.decodes.poll():
            if isinstance(outcome, RequestRejected):
                replies.append(refusal(payload, outcome.code, str(outcome)))
            elif isinstance(outcome, BaseException):
                replies.append(refusal(payload, INTERNAL_ERROR, f"the audio could not be decoded: {outcome}"))
            else:
                self.jobs.append(Job(payload, samples=outcome))
        if not self.jobs:
            if not replies:
                self.decodes.wait(IDLE_WAIT_S)
            return replies
        job = self.jobs[0]
        started = time.perf_counter()
        try:
            done = job.step(self.model)
            if done:
                replies.append(job.reply())
        except RequestRejected as exc:
            done = True
            replies.append(refusal(job.msg, exc.code, str(exc)))
        except Exception as exc:
            log.exception("[audio] rid=%s failed", job.msg.rid)
            done = True
            replies.append(refusal(job.msg, INTERNAL_ERROR, f"the model failed on this request: {exc}"))
        log.debug("[audio] rid=%s piece=%d %.2fs", job.msg.rid, job.at, time.perf_counter() - started)
        if done:
            self.jobs.pop(0)
            self.release()
        return replies

    def withdraw(self, rid: str, code: str, message: str) -> Reply | None:
        for job in self.jobs:
            if job.msg.rid == rid:
                self.jobs.remove(job)
                return refusal(job.msg, code, message)
        return None if not self.decodes.drop(rid) else Transcribed(rid, code=code, message=message)

    def fail_all(self, code: str, message: str) -> list[Reply]:
        replies = [refusal(j.msg, code, message) for j in self.jobs]
        replies += [Transcribed(rid, code=code, message=message) for rid in self.decodes.rids]
        for rid in self.decodes.rids:
            self.decodes.drop(rid)
        self.jobs = []
        return replies

    def _serves(self, msg: Message) -> str:
        serves = "a text-to-speech model: it serves /v1/audio/speech" if self.speaks else \
            "a speech-to-text model: it serves /v1/audio/transcriptions and /v1/audio/translations"
        return f"this model is {serves}, not {msg.KIND}"

    # --- EngineApi: no generation ----------------------------------------------------------

    @property
    def caches(self) -> PromptCacheApi | None:
        return None

    @property
    def rids(self) -> list[str]:
        return [j.msg.rid for j in self.jobs] + self.decodes.rids

    def __len__(self) -> int:
        return len(self.jobs) + len(self.decodes)

    def batch_size(self) -> int:
        return 0

    def waiting(self) -> int:
        return len(self)

    def submit(self, msg: Submit) -> None:
        raise RequestRejected(INVALID_REQUEST, self._serves(msg).replace("not submit", "not chat or completions"))

    def tokenize(self, msg: Submit) -> list[int]:
        raise RequestRejected(INVALID_REQUEST, self._serves(msg).replace("not submit", "not chat or completions"))

    def abort(self, rid: str) -> bool:
        return self.withdraw(rid, "aborted", "") is not None

    # the rest of EngineApi as an embedding engine has it (no generation batch, no caches; settle drops the model)
    plan_step = EmbeddingEngine.plan_step
    step = EmbeddingEngine.step
    after_send = EmbeddingEngine.after_send
    warm_step = EmbeddingEngine.warm_step
    close_caches = EmbeddingEngine.close_caches
    settle = EmbeddingEngine.settle
