"""The wire format: golden bytes per message keep it stable; the decoder stops bad input at the boundary."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, VersionMismatch, decode, encode
from protocol.messages import (
    ALL_MESSAGES,
    PROTOCOL_VERSION,
    Abort,
    Bye,
    CacheCleared,
    CacheStats,
    ClearCache,
    Embed,
    Embedded,
    Evict,
    Failed,
    Finished,
    Heartbeat,
    Load,
    Progress,
    Pulse,
    Ready,
    Rerank,
    Reranked,
    Speak,
    Spoken,
    SpokenPart,
    Standby,
    StepStarted,
    Submit,
    Tokenize,
    Tokenized,
    Tokens,
    Transcribe,
    Transcribed,
)
from tests.unit.golden import GOLDEN_SHA256

SAMPLES = [
    Submit(rid="r1", max_tokens=16, messages=[{"role": "user", "content": "hi"}], temperature=0.0, stop=["\n"]),
    Submit(rid="r2", max_tokens=0, prompt="Once", top_p=0.9, top_k=40, min_p=0.05, ignore_eos=True,
           resume_tokens=[17, 4, 255]),
    Submit(rid="r3", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
           tools=[{"name": "f", "description": "", "parameters": {"type": "object"}}],
           template_kwargs={"enable_thinking": False}, constraint={"type": "tool", "names": ["f"], "parallel": False},
           logprobs=2, seed=7, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
           logit_bias=[[5, -100.0]], reasoning_budget=64, cache_mark=[[1, 300.0]]),
    Submit(rid="r4", max_tokens=8, prompt_ids=[1, 2, 3], more=3),
    Abort(rid="r1"),
    Evict(mode="drain", deadline_s=2.5),
    Progress(stage="weights", fraction=0.5),
    Standby(pid=7),
    Load(args=["--model-path", "/m", "--model-id", "m"]),
    Ready(model_id="m", pid=42, context_length=8192, vocab_size=1024, weights_bytes=10, memory_bytes=20, load_s=0.5),
    Tokens(chunks=[["r1", "héllo", 1, [300]], ["r2", "", 2, [195, 169], {"reasoning": "hm",
                                                                        "calls": [[0, "call_1", "f", "{"]],
                                                                        "logprobs": [["a", -0.5, [["a", -0.5]]]]}]]),
    Finished(rid="r1", text="!", finish_reason="tool_calls", prompt_tokens=3, completion_tokens=4, cached_tokens=2,
             token_ids=[33], extra={"calls": [[0, "", "", "}"]]}, cache_written=1),
    Failed(rid="r1", code="model_evicted", message="gone"),
    Heartbeat(active=1, waiting=0, batch_size=1, max_batch_size=16, generated_tokens=99, memory_bytes=1 << 30),
    StepStarted(predicted_s=0.75, prefill_tokens=128, decoding=8),
    Pulse(turn_s=45.5, window_s=1.5, cpu_s=2.9, where="mlx_lm/generate.py:1232 prompt"),
    ClearCache(rid="c1", which="ssd"),
    CacheStats(block_tokens=64, hot_entries=3, hot_bytes=3 << 20, hot_budget_bytes=1 << 30, hot_hits=2, hot_misses=1,
               hot_hit_tokens=128, ssd_enabled=True, ssd_entries=5, ssd_bytes=5 << 20, ssd_cap_bytes=8 << 30,
               ssd_hits=1, ssd_misses=1, ssd_hit_tokens=64, ssd_dir="/s/cache/abc", ssd_error=None),
    CacheCleared(rid="c1", which="ssd", entries=5, reclaimed_bytes=5 << 20),
    Tokenize(rid="t1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
             tools=[{"name": "f", "description": "", "parameters": {"type": "object"}}],
             template_kwargs={"continue_final_message": True}, ids=True),
    Tokenized(rid="t1", count=3, ids=[1, 2, 3]),
    Embed(rid="e1", inputs=["héllo", [101, 7592, 102]], truncate=0, dimensions=2, input_type="query",
          instruction="Find the passage"),
    Embedded(rid="e1", vectors=[[0.6, -0.8], [1.0, 0.0]], tokens=6),
    Rerank(rid="k1", query="which?", documents=["a", "b"], instruction="Judge", truncate=64),
    Reranked(rid="k1", scores=[0.25, 0.75], tokens=12),
    Transcribe(rid="a1", audio=b"RIFF\x00", media_type="audio/wav", task="translate", language="de", prompt="Hi",
               temperature=0.2, words=True, max_audio_s=600.0),
    Transcribed(rid="a1", text=" hi", language="en", duration=1.5,
                segments=[{"id": 0, "start": 0.0, "end": 1.5, "text": " hi",
                           "words": [{"word": " hi", "start": 0.1, "end": 0.4, "probability": 0.9}]}]),
    Speak(rid="s1", input="héllo", voice="af_heart", speed=1.25, response_format="flac"),
    SpokenPart(rid="s1", audio=b"ID3\x04", sample_rate=24000),
    Spoken(rid="s1", audio=b"fLaC\x00", sample_rate=24000, samples=2),
    Bye(reason="evict", aborted=1, drained=2, phases={"settle": 0.01}, memory_bytes=5),
]

def _key(msg) -> str:
    return f"{msg.KIND}:{msg.rid}" if isinstance(msg, Submit) else msg.KIND


def test_every_message_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=_key)
def test_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_key)
def test_golden_bytes(msg) -> None:
    """A change here is a wire change: it needs a PROTOCOL_VERSION bump."""
    assert hashlib.sha256(encode(msg)).hexdigest() == GOLDEN_SHA256[_key(msg)]


def test_frames_carry_the_version_and_kind() -> None:
    body = msgpack.unpackb(encode(Abort(rid="x")))
    assert body == {"v": PROTOCOL_VERSION, "k": "abort", "rid": "x"}


def _frame(**body) -> bytes:
    return msgpack.packb(body)


@pytest.mark.parametrize("frame, match", [
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (_frame(v=PROTOCOL_VERSION, k="nope"), "unknown message kind"),
    (_frame(v=PROTOCOL_VERSION), "unknown message kind"),
    (_frame(v=PROTOCOL_VERSION, k="abort"), "missing field 'rid'"),
    (_frame(v=PROTOCOL_VERSION, k="abort", rid=7), "expected"),
    (_frame(v=PROTOCOL_VERSION, k="submit", rid="a", max_tokens=True), "expected"),
    (_frame(v=PROTOCOL_VERSION, k="submit", rid="a", max_tokens=1.5), "expected"),
    (_frame(v=PROTOCOL_VERSION, k="abort", rid="a", extra=1), "unknown fields"),
    (_frame(v=PROTOCOL_VERSION, k="tokens", chunks="x"), "expected"),
    (_frame(v=PROTOCOL_VERSION, k="clear_cache", rid="c", which=None), "expected"),
    (_frame(v=PROTOCOL_VERSION, k="cache_cleared", rid="c", which="hot", entries=1, reclaimed_bytes=True), "expected"),
])
def test_decoder_rejects_malformed_frames(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_decoder_refuses_other_versions() -> None:
    with pytest.raises(VersionMismatch) as err:
        decode(_frame(v=PROTOCOL_VERSION + 1, k="abort", rid="a"))
    assert err.value.version == PROTOCOL_VERSION + 1


def test_decoder_refuses_oversized_frames() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_no_pickle_or_extension_types() -> None:
    ext = msgpack.packb({"v": PROTOCOL_VERSION, "k": "abort", "rid": msgpack.ExtType(1, b"x")})
    with pytest.raises(ProtocolError):
        decode(ext)
