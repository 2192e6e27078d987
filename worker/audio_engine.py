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

Speech streams: each chunk's samples go to the encoding thread (`Encodes`: worker/audio_codec.py's SpeechEncoder,
one per request, fed in order), so no encoding runs on the loop's thread; the bytes it has encoded go out as a
SpokenPart at the next turn, and a request's next chunk is spoken only once its last one's bytes are out (a turn
waits at most IDLE_WAIT_S for them), so its first bytes leave while the rest is still to be spoken. Its encoder's
last bytes end it (Spoken, with the samples' count).

Invariants: every enqueued request is answered exactly once (Transcribed or Spoken: its result, or a code), a Speak
after its SpokenParts; a model or encoder error fails that request alone (INTERNAL_ERROR) and the engine goes on.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from protocol.messages import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    Message,
    Speak,
    Spoken,
    SpokenPart,
    Submit,
    Transcribe,
    Transcribed,
)
from worker.audio_codec import SpeechEncoder, check_audio, check_format, decode_audio
from worker.embedding_engine import EmbeddingEngine
from worker.engine_api import PromptCacheApi, RequestRejected
from worker.image_decode import DECODE_DEADLINE_S, Decodes

log = logging.getLogger(__name__)

Reply = Transcribed | Spoken | SpokenPart
TASKS = ("transcribe", "translate")
MAX_INPUT_CHARS = 4096  # OpenAI's limit on /v1/audio/speech's input
SPEEDS = (0.25, 4.0)
IDLE_WAIT_S = 0.05  # with only decodes or encodings in flight, a turn waits this long for one to end (not a busy loop)
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


def transcribe_all(model: Transcriber, samples: Any, msg: Transcribe) -> Transcribed:
    """The whole file window by window, as the engine does it over several turns: the in-process reference."""
    job = Job(msg, samples)
    while not job.step(model):
        pass
    return job.reply()


def speak_all(model: Speaker, msg: Speak) -> Any:
    """The whole speech's samples, chunk by chunk, as the engine speaks them over several turns: the in-process
    reference (float32 at the model's rate)."""
    import numpy as np

    voice = msg.voice or model.voices[0]
    pieces = [np.asarray(model.speak(p, voice, msg.speed), np.float32).reshape(-1) for p in chunks(msg.input)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


@dataclass
class Job:
    """One request past its decode: its samples (a transcription) or its text chunks (a synthesis), and the results
    of the windows or chunks done (a synthesis: its last chunk's samples, for its encoder)."""

    msg: Transcribe | Speak
    samples: Any = None
    pieces: list[str] = field(default_factory=list)
    at: int = 0  # the next window or chunk
    text: list[str] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)
    language: str = ""
    rate: int = 0
    encoder: SpeechEncoder | None = None
    piece: Any = None
    spoken: int = 0  # samples spoken so far
    encoding: int = 0  # pieces handed to the encoding thread and not yet back
    closed: bool = False  # its encoder's close is handed over: nothing more goes to it
    dropped: bool = False  # answered already (withdrawn or failed): what its encoder still yields is not sent

    def step(self, model: Any) -> bool:
        """Run the next window or chunk; True once none is left."""
        if isinstance(self.msg, Speak):
            self.rate = model.rate
            self.piece = model.speak(self.pieces[self.at], self.msg.voice or model.voices[0], self.msg.speed)
            self.spoken += len(self.piece)
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

    def reply(self) -> Transcribed:
        assert isinstance(self.msg, Transcribe)
        return Transcribed(self.msg.rid, "".join(self.text), self.language, round(len(self.samples) / self.rate, 3),
                           self.segments)


def refusal(msg: Transcribe | Speak, code: str, message: str) -> Transcribed | Spoken:
    return Transcribed(msg.rid, code=code, message=message) if isinstance(msg, Transcribe) else \
        Spoken(msg.rid, code=code, message=message)


class Encodes:
    """Speech encoded on a thread of its own ("audio-encode"), in the order it was handed over: the loop's thread
    hands each piece over (`put`) and takes what has been encoded (`poll`), never waiting for an encoder (Ogg Opus
    takes about a tenth of the audio's length here). Each outcome is (job, last, bytes or the exception raised)."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[tuple[Job, Callable[[], bytes], bool] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Job, bool, bytes | BaseException]] = queue.SimpleQueue()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self.pending = 0  # handed over and not yet polled

    def put(self, job: Job, work: Callable[[], bytes], last: bool = False) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="audio-encode", daemon=True)
            self._thread.start()
        job.encoding += 1
        job.closed = job.closed or last
        self.pending += 1
        self._todo.put((job, work, last))

    def poll(self) -> list[tuple[Job, bool, bytes | BaseException]]:
        self._ended.clear()  # before looking: an encoding that ends after this wakes the next `wait`
        out = []
        while self.pending:
            try:
                job, last, outcome = self._done.get_nowait()
            except queue.Empty:
                break
            job.encoding -= 1
            self.pending -= 1
            out.append((job, last, outcome))
        return out

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for an encoding to end (none in flight: at once)."""
        if self.pending:
            self._ended.wait(timeout_s)

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            job, work, last = item
            try:
                outcome: bytes | BaseException = work()
            except Exception as exc:  # the request's failure, answered by the loop's thread
                outcome = exc
            self._done.put((job, last, outcome))
            self._ended.set()


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
        self.encodes = Encodes()
        self.closing: list[Job] = []  # syntheses spoken whole, their encoder's last bytes still to come
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
            pieces = self._pieces(msg)
            self.jobs.append(Job(msg, pieces=pieces, encoder=SpeechEncoder(self.model.rate, msg.response_format)))
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
        check_format(msg.response_format)  # aac: no encoder, saying so
        return chunks(msg.input)

    def embed_step(self) -> list[Reply]:
        """Take the ended decodes and encodings, and return them; with none, run one window or chunk of the oldest
        job (a synthesis's next chunk once its last one's bytes are out); the replies and parts to send."""
        replies = self._decoded() + self._encoded()
        job = self.jobs[0] if self.jobs else None
        if job is None or job.encoding or replies:  # what is done leaves before the next piece of work starts
            if not replies:
                self.encodes.wait(IDLE_WAIT_S) if self.encodes.pending else self.decodes.wait(IDLE_WAIT_S)
            return replies
        started = time.perf_counter()
        try:
            done = job.step(self.model)
            if isinstance(job.msg, Speak):
                assert job.encoder is not None
                self.encodes.put(job, partial(job.encoder.write, job.piece))
                if done:
                    self.encodes.put(job, job.encoder.close, last=True)
                    self.closing.append(job)
            elif done:
                replies.append(job.reply())
        except RequestRejected as exc:
            done = True
            replies.append(self._drop(job, exc.code, str(exc)))
        except Exception as exc:
            log.exception("[audio] rid=%s failed", job.msg.rid)
            done = True
            replies.append(self._drop(job, INTERNAL_ERROR, f"the model failed on this request: {exc}"))
        log.debug("[audio] rid=%s piece=%d %.2fs", job.msg.rid, job.at, time.perf_counter() - started)
        if done:
            if job in self.jobs:
                self.jobs.remove(job)
            self.release()
        return replies

    def _decoded(self) -> list[Reply]:
        replies: list[Reply] = []
        for payload, outcome in self.decodes.poll():
            if isinstance(outcome, RequestRejected):
                replies.append(refusal(payload, outcome.code, str(outcome)))
            elif isinstance(outcome, BaseException):
                replies.append(refusal(payload, INTERNAL_ERROR, f"the audio could not be decoded: {outcome}"))
            else:
                self.jobs.append(Job(payload, samples=outcome))
        return replies

    def _encoded(self) -> list[Reply]:
        replies: list[Reply] = []
        for job, last, outcome in self.encodes.poll():
            rid = job.msg.rid
            if job.dropped:
                continue
            if isinstance(outcome, BaseException):
                log.error("[audio] rid=%s encoding failed: %s", rid, outcome)
                replies.append(self._drop(job, INTERNAL_ERROR, f"the speech could not be encoded: {outcome}"))
            elif last:
                self.closing.remove(job)
                replies.append(Spoken(rid, outcome, job.rate, job.spoken))
            elif outcome:
                replies.append(SpokenPart(rid, outcome, job.rate))
        return replies

    def _drop(self, job: Job, code: str, message: str) -> Transcribed | Spoken:
        """Answer a job with `code` now; its encoder, if it has one, is still closed on the encoding thread."""
        job.dropped = True
        self.jobs = [j for j in self.jobs if j is not job]
        self.closing = [j for j in self.closing if j is not job]
        if job.encoder is not None and not job.closed:
            self.encodes.put(job, job.encoder.close, last=True)
        return refusal(job.msg, code, message)

    def withdraw(self, rid: str, code: str, message: str) -> Transcribed | Spoken | None:
        for job in (*self.jobs, *self.closing):
            if job.msg.rid == rid:
                return self._drop(job, code, message)
        return None if not self.decodes.drop(rid) else Transcribed(rid, code=code, message=message)

    def fail_all(self, code: str, message: str) -> list[Reply]:
        replies: list[Reply] = [self._drop(j, code, message) for j in (*self.jobs, *self.closing)]
        replies += [Transcribed(rid, code=code, message=message) for rid in self.decodes.rids]
        for rid in self.decodes.rids:
            self.decodes.drop(rid)
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
        return [j.msg.rid for j in (*self.jobs, *self.closing)] + self.decodes.rids

    def __len__(self) -> int:
        return len(self.jobs) + len(self.closing) + len(self.decodes)

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
