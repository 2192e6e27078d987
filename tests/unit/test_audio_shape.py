"""OpenAI's audio shapes, pure (supervisor/gateway/audio_shape.py): subtitles, verbose_json, the stream's events."""

from __future__ import annotations

from supervisor.gateway.audio_shape import srt, stamp, transcription_body, transcription_events, vtt

SEGMENTS = [{"id": 0, "start": 0.0, "end": 1.5, "text": " Hello there.", "tokens": [1, 2], "temperature": 0.0,
             "words": [{"word": " Hello", "start": 0.0, "end": 0.6}, {"word": " there.", "start": 0.6, "end": 1.5}]},
            {"id": 1, "start": 3661.25, "end": 3662.0, "text": " Bye.", "tokens": [3]}]


def test_timestamps_in_each_subtitle_format() -> None:
    assert stamp(3661.2504, ",") == "01:01:01,250" and stamp(-0.1, ".") == "00:00:00.000"
    assert srt(SEGMENTS) == "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n01:01:01,250 --> 01:01:02,000\nBye.\n\n"
    assert vtt(SEGMENTS).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n")


def test_verbose_json_gives_what_the_granularities_ask() -> None:
    body, media_type = transcription_body("verbose_json", "transcribe", "en", 3662.0, " Hello there. Bye.", SEGMENTS,
                                          ("word",))
    assert media_type == "application/json" and isinstance(body, dict)
    assert body["language"] == "english" and "segments" not in body
    assert body["words"] == [{"word": "Hello", "start": 0.0, "end": 0.6}, {"word": "there.", "start": 0.6, "end": 1.5}]
    body, _ = transcription_body("verbose_json", "translate", "xx", 1.0, "t", SEGMENTS)
    assert isinstance(body, dict) and body["language"] == "xx" and len(body["segments"]) == 2
    assert body["segments"][1]["avg_logprob"] == 0 and "words" not in body
    assert transcription_body("text", "transcribe", "en", 1.0, "hi", [])[0] == "hi"


def test_stream_events_are_the_segments_then_done() -> None:
    events = transcription_events(" Hello there. Bye.", SEGMENTS, 3662.0)
    assert [e["type"] for e in events] == ["transcript.text.delta"] * 2 + ["transcript.text.done"]
    assert events[-1]["text"] == " Hello there. Bye."
    assert [e["delta"] for e in transcription_events("x", [], 1.0)[:-1]] == ["x"]


def test_multipart_passes_the_guard_only_on_the_upload_paths_and_never_from_a_foreign_page() -> None:
    import asyncio

    import httpx
    from starlette.responses import PlainTextResponse

    from supervisor.gateway.audio_routes import UPLOAD_PATHS
    from supervisor.gateway.guard import WebGuard

    async def ok(scope, receive, send) -> None:
        await PlainTextResponse("ok")(scope, receive, send)

    guard = WebGuard(ok, multipart=UPLOAD_PATHS)

    async def post(path: str, **headers: str) -> int:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8800") as c:
            r = await c.post(path, files={"file": ("a.wav", b"RIFF")}, headers=headers)
            return r.status_code

    assert asyncio.run(post("/v1/audio/transcriptions")) == 200
    assert asyncio.run(post("/v1/chat/completions")) == 415
    assert asyncio.run(post("/v1/audio/transcriptions", origin="http://evil.example.com")) == 403
