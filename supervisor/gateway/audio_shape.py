"""OpenAI's audio shapes, pure: a transcription as each response_format writes it, its stream's events, and
what a speech format's content type is.

`transcription_body` answers json ({"text"}), text, srt, vtt and verbose_json (task, language, duration, text,
segments, and words when `timestamp_granularities[]` asked for them; segments only when asked for them, if
granularities were given); srt and vtt number and time the segments (HH:MM:SS,mmm and HH:MM:SS.mmm).
`transcription_events` are the `transcript.text.delta` events (a segment's text each) and the closing
`transcript.text.done`, as OpenAI's streamed transcriptions send them.
"""

from __future__ import annotations

from typing import Any

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
SPEECH_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                "wav": "audio/wav", "pcm": "audio/pcm"}
LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
                  "pt": "portuguese", "nl": "dutch", "ja": "japanese", "zh": "chinese", "ru": "russian",
                  "ko": "korean", "pl": "polish", "tr": "turkish", "sv": "swedish", "ar": "arabic", "hi": "hindi"}
SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio",
                  "no_speech_prob")


def stamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[dict]) -> str:
    return "".join(f"{i}\n{stamp(s['start'], ',')} --> {stamp(s['end'], ',')}\n{s['text'].strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: list[dict]) -> str:
    return "WEBVTT\n\n" + "".join(f"{stamp(s['start'], '.')} --> {stamp(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                  for s in segments)


def verbose(task: str, language: str, duration: float, text: str, segments: list[dict],
            granularities: tuple[str, ...]) -> dict:
    body: dict[str, Any] = {"task": task, "language": LANGUAGE_NAMES.get(language, language), "duration": duration,
                            "text": text}
    if not granularities or "segment" in granularities:
        body["segments"] = [{k: s.get(k, 0 if k != "tokens" else []) for k in SEGMENT_FIELDS} for s in segments]
    if "word" in granularities:
        body["words"] = [{"word": w["word"].strip(), "start": w["start"], "end": w["end"]}
                         for s in segments for w in s.get("words", [])]
    return body


def transcription_body(fmt: str, task: str, language: str, duration: float, text: str, segments: list[dict],
                       granularities: tuple[str, ...] = ()) -> tuple[str | dict, str]:
    """(body, media type): a dict for the JSON formats, text for the others."""
    if fmt == "text":
        return text, "text/plain; charset=utf-8"
    if fmt == "srt":
        return srt(segments), "application/x-subrip; charset=utf-8"
    if fmt == "vtt":
        return vtt(segments), "text/vtt; charset=utf-8"
    if fmt == "verbose_json":
        return verbose(task, language, duration, text, segments, granularities), "application/json"
    return {"text": text, "usage": {"type": "duration", "seconds": round(duration)}}, "application/json"


def transcription_events(text: str, segments: list[dict], duration: float) -> list[dict]:
    """A segment's text per delta (the whole text in one when there are no segments), then the done event."""
    pieces = [s["text"] for s in segments] if segments and "".join(s["text"] for s in segments) == text else [text]
    return [*({"type": "transcript.text.delta", "delta": p} for p in pieces if p),
            {"type": "transcript.text.done", "text": text, "usage": {"type": "duration", "seconds": round(duration)}}]
