"""OpenAI's audio API: `POST /v1/audio/transcriptions` and `/v1/audio/translations` (multipart: file,
model, language, prompt, temperature, response_format, timestamp_granularities[], stream) answered by a speech-to-text
model's worker (Transcribe), and `POST /v1/audio/speech` (JSON: model, input, voice, response_format, speed,
stream_format) by a text-to-speech model's worker (Speak).

Only a model of the route's kind is asked (protocol/modelkind.py: stt, tts); any other is a 400 before a worker
starts. The multipart body is read under `[server] audio_max_bytes` (OpenAI's 25 MB by default) and refused past it
with a 400 as soon as it passes (never buffered whole first); the file's bytes go to the worker as sent, which
names their format from the bytes themselves (a lying content type changes nothing) and refuses a bad file with
its reason (worker/audio_codec.py): every bad input is a 400 in OpenAI's error shape, the worker alive. Streams:
a transcription's `stream=true` sends `transcript.text.delta` events, a segment each, then `transcript.text.done`,
once the transcription is whole. Speech streams as it is spoken: the worker sends each sentence's bytes as soon as
they are encoded (SpokenPart), and the response starts with the first of them, so playback starts while the rest
is still being spoken; every refusal comes before it (a 400 or the worker's code, as a status). `stream_format`
audio is the chunked body of the format (pcm, wav with a streaming header, mp3, opus stream; flac, whose header is
written last, comes whole at the end with X-Audio-Samples), `sse` is OpenAI's `speech.audio.delta` events of base64
audio (at most STREAM_CHUNK bytes each) and a closing `speech.audio.done` (usage counts no tokens: the model reads
phonemes). A failure after the first bytes ends an audio body unfinished (the connection is cut, so a player can tell
it from the end) and an SSE stream with an `error` event. A client that leaves withdraws the request from the
worker (Router.ask's Abort) and lets its lease go.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from protocol.messages import Message, Speak, Spoken, SpokenPart, Transcribe, Transcribed
from protocol.modelkind import STT, TTS
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.audio_shape import (
    GRANULARITIES,
    SPEECH_TYPES,
    TRANSCRIPTION_FORMATS,
    transcription_body,
    transcription_events,
)
from supervisor.gateway.http import SSEResponse, read_body, read_json, sse, unless_client_leaves
from supervisor.gateway.worker_ask import ask_worker
from supervisor.router import Router

log = logging.getLogger(__name__)
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                           "verse", "marin", "cedar"})  # OpenAI's voices: a model's default voice speaks for each
UPLOAD_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")  # multipart bodies (supervisor/gateway/guard.py)
STREAM_CHUNK = 16 * 1024
MAX_FIELD_BYTES = 64 * 1024  # a multipart text field (prompt, language, ...)
NO_USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}


def _bad(message: str, param: str | None = None) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, param=param)


async def read_form(request: Request, limit: int) -> Any:
    """The multipart form, read under `limit` bytes (a 400 past it); a body of another type is a 400."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise _bad("the request body must be multipart/form-data (a file and the fields)")
    try:
        body = await read_body(request, limit)
    except errors.PayloadTooLarge:
        raise _bad(f"the multipart body exceeds the limit of {limit} bytes ([server] audio_max_bytes)",
                   param="file") from None
    request._body = body  # starlette's form parser reads the body it has, not the stream again
    try:
        return await request.form(max_files=1, max_fields=32, max_part_size=MAX_FIELD_BYTES)
    except Exception as exc:  # python-multipart's or starlette's refusal of a malformed body
        raise _bad(f"the multipart body cannot be parsed: {getattr(exc, 'detail', exc)}") from None


def _text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"{name} must be a text field, not a file", param=name)
    return value


def _number(value: str | None, name: str, low: float, high: float, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise _bad(f"{name} must be a number", param=name) from None
    if not low <= number <= high:
        raise _bad(f"{name} must be between {low:g} and {high:g}", param=name)
    return number


class AudioRoutes:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings

    def _model(self, name: Any, kind: str, route: str) -> str:
        if not isinstance(name, str) or not name:
            raise _bad("model is required (a string)", param="model")
        spec = self.router.registry.resolve(name)
        if spec.kind != kind:
            wants = "a speech-to-text (stt) model" if kind == STT else "a text-to-speech (tts) model"
            raise _bad(f"'{spec.id}' is a {spec.kind} model: {route} needs {wants}", param="model")
        return spec.id

    async def transcriptions(self, request: Request) -> Response:
        return await self._transcribe(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._transcribe(request, "translate")

    async def _transcribe(self, request: Request, task: str) -> Response:
        route = "/v1/audio/transcriptions" if task == "transcribe" else "/v1/audio/translations"
        form = await read_form(request, self.settings.audio_max_bytes)
        model = self._model(_text(form, "model"), STT, route)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise _bad("file is required (the audio file, a multipart file part)", param="file")
        audio = await upload.read()
        fmt = _text(form, "response_format") or "json"
        if fmt not in TRANSCRIPTION_FORMATS:
            raise _bad(f"response_format must be one of {', '.join(TRANSCRIPTION_FORMATS)}", param="response_format")
        granularities = tuple(v for v in form.getlist("timestamp_granularities[]") + form.getlist(
            "timestamp_granularities") if isinstance(v, str))
        if any(g not in GRANULARITIES for g in granularities):
            raise _bad(f"timestamp_granularities[] takes {' and '.join(GRANULARITIES)}",
                       param="timestamp_granularities")
        if granularities and fmt != "verbose_json":
            raise _bad("timestamp_granularities[] needs response_format verbose_json", param="timestamp_granularities")
        language = _text(form, "language") if task == "transcribe" else None
        if language is not None and not (language.isalpha() and 2 <= len(language) <= 3):
            raise _bad("language must be an ISO-639-1 code (en, de, ...)", param="language")
        temperature = _number(_text(form, "temperature"), "temperature", 0.0, 1.0, 0.0)
        stream = (_text(form, "stream") or "false").lower() == "true"
        msg = lambda rid: Transcribe(rid, audio, upload.content_type or "", task, language or None,  # noqa: E731
                                     _text(form, "prompt") or None, temperature, "word" in granularities,
                                     float(self.settings.max_audio_s))
        reply = await ask_worker(self.router, model, msg, self.settings.embed_timeout_s, "transcribe the audio",
                                 param="file", request=request, silence=True)
        assert isinstance(reply, Transcribed)
        if stream:
            events = transcription_events(reply.text, reply.segments, reply.duration)
            return SSEResponse(_frames([sse(e) for e in events] + [b"data: [DONE]\n\n"]), lambda: None)
        body, media_type = transcription_body(fmt, task, reply.language, reply.duration, reply.text, reply.segments,
                                              granularities)
        if isinstance(body, dict):
            return JSONResponse(body)
        return PlainTextResponse(body, media_type=media_type)

    async def speech(self, request: Request) -> Response:
        body = await read_json(request, self.settings.max_body_bytes)
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = self._model(body.get("model"), TTS, "/v1/audio/speech")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise _bad("input is required: a non-empty string", param="input")
        voice = body.get("voice")
        voice = voice.get("id") if isinstance(voice, dict) else voice
        if voice is not None and not isinstance(voice, str):
            raise _bad("voice must be a string (a voice of the model's, or one of OpenAI's)", param="voice")
        fmt = body.get("response_format", "mp3")
        if fmt not in SPEECH_TYPES:
            raise _bad(f"response_format must be one of {', '.join(SPEECH_TYPES)}", param="response_format")
        speed = body.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
            raise _bad("speed must be a number between 0.25 and 4.0", param="speed")
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise _bad("stream_format must be audio or sse", param="stream_format")
        own_voice = None if voice is None or voice in OPENAI_VOICES else voice
        speech = SpeechParts()
        asking = asyncio.ensure_future(ask_worker(
            self.router, model, lambda rid: Speak(rid, text, own_voice, float(speed), fmt),
            self.settings.embed_timeout_s, "speak the input", param="input", silence=True, on_part=speech.part))
        asking.add_done_callback(speech.ended)
        try:
            first = await unless_client_leaves(speech.next(), request.receive, "speech-first-part")
        except BaseException:
            await _settle(asking)
            raise
        if stream_format == "sse":
            return SSEResponse(_speech_events(first, speech, asking), lambda: None)
        if isinstance(first, Spoken):  # nothing came before the end (flac): the whole file
            return Response(first.audio, media_type=SPEECH_TYPES[fmt],
                            headers={"X-Audio-Sample-Rate": str(first.sample_rate),
                                     "X-Audio-Samples": str(first.samples)})
        return SSEResponse(_speech_bytes(first, speech, asking), lambda: None, SPEECH_TYPES[fmt],
                           {"X-Audio-Sample-Rate": str(first.sample_rate)})


async def _frames(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


class SpeechParts:
    """A Speak's parts as the worker sends them (Router.ask's `on_part`), then its ask's outcome: `next` returns each
    SpokenPart in order, then the closing Spoken, or raises the error the ask ended with."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[SpokenPart | asyncio.Future] = asyncio.Queue()

    def part(self, msg: Message) -> None:
        assert isinstance(msg, SpokenPart)
        self.queue.put_nowait(msg)

    def ended(self, asking: asyncio.Future) -> None:
        self.queue.put_nowait(asking)

    async def next(self) -> SpokenPart | Spoken:
        item = await self.queue.get()
        if isinstance(item, SpokenPart):
            return item
        reply = item.result()
        assert isinstance(reply, Spoken)
        return reply


async def _settle(asking: asyncio.Future) -> None:
    """The ask ended: cancelled if it still runs (Router.ask withdraws it from the worker), its lease let go."""
    asking.cancel()
    await asyncio.gather(asking, return_exceptions=True)


async def _speech_bytes(first: SpokenPart, speech: SpeechParts, asking: asyncio.Future) -> AsyncIterator[bytes]:
    try:
        item: SpokenPart | Spoken = first
        while isinstance(item, SpokenPart):
            yield item.audio
            try:
                item = await speech.next()
            except errors.MlxsupError as exc:  # after the first bytes: the body ends unfinished (the connection cut)
                log.warning("[speech] failed mid-stream: %s", exc.message)
                raise
        yield item.audio
    finally:
        await _settle(asking)


async def _speech_events(first: SpokenPart | Spoken, speech: SpeechParts,
                         asking: asyncio.Future) -> AsyncIterator[bytes]:
    try:
        item = first
        while True:
            for i in range(0, len(item.audio), STREAM_CHUNK):
                audio = base64.b64encode(item.audio[i:i + STREAM_CHUNK]).decode()
                yield sse({"type": "speech.audio.delta", "audio": audio})
            if isinstance(item, Spoken):
                break
            item = await speech.next()
        yield sse({"type": "speech.audio.done", "usage": NO_USAGE})
    except errors.MlxsupError as exc:
        log.warning("[speech] failed mid-stream: %s", exc.message)
        yield sse({"type": "error", **exc.body()})
    finally:
        await _settle(asking)


def audio_routes(router: Router, settings: Settings) -> list[Route]:
    routes = AudioRoutes(router, settings)
    return [Route("/v1/audio/transcriptions", routes.transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", routes.translations, methods=["POST"]),
            Route("/v1/audio/speech", routes.speech, methods=["POST"])]

