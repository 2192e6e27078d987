"""Audio files in and out of an audio model's worker, with soundfile (libsndfile 1.2) and numpy; no MLX.

`sniff` names a file's format from its first bytes, whatever content type the client claimed (a lying content type
changes nothing: the bytes decide); `check_audio` reads only the header (cheap, on the loop's thread): its format,
channels, rate and duration against the request's limit; `decode_audio` (on a thread of worker/image_decode.py's
`Decodes`, with a deadline: a file's decoding never runs on the loop's thread) decodes it whole to float32 mono at
the model's rate: channels averaged, other rates resampled linearly (np.interp). Formats: WAV, FLAC, MP3, OGG
(Vorbis or Opus); others (MP4/M4A, WebM) are refused, naming the ones taken. A malformed or truncated file is
refused with libsndfile's reason, as a file that decodes to no samples is.

`encode_audio` writes a model's float samples as a response format: wav (16-bit PCM), flac, mp3, opus (Ogg, 48 kHz,
libsndfile's only Opus rate: resampled), pcm (raw 16-bit little-endian, the model's rate). AAC is refused:
no encoder comes with the registries' packages (libsndfile has none).
"""

from __future__ import annotations

import io
from typing import Any

from protocol.messages import INVALID_REQUEST
from worker.engine_api import RequestRejected

FORMATS = ("WAV", "FLAC", "MP3", "OGG")  # what libsndfile may open here: nothing else is parsed
RESPONSE_FORMATS = ("wav", "flac", "mp3", "opus", "pcm")
REFUSED_FORMATS = {"aac": "no AAC encoder is available (libsndfile has none): ask for mp3, opus, flac, wav or pcm"}
OPUS_RATE = 48000


def _bad(message: str) -> RequestRejected:
    return RequestRejected(INVALID_REQUEST, message)


def sniff(data: bytes) -> str | None:
    """The container a file's first bytes name (one of FORMATS), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    return None


def check_audio(data: bytes, max_audio_s: float = 0.0) -> tuple[str, float]:
    """(format, seconds) from the header, or RequestRejected saying what is wrong with the file."""
    import soundfile as sf

    if not data:
        raise _bad("the audio file is empty (0 bytes)")
    fmt = sniff(data)
    if fmt is None:
        kind = "an MP4/M4A file" if data[4:8] == b"ftyp" else "WebM" if data[:4] == b"\x1aE\xdf\xa3" else \
            "not an audio file this server reads"
        raise _bad(f"the file is {kind}: send WAV, MP3, FLAC or OGG (Vorbis, Opus)")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as exc:  # libsndfile's reason: a malformed header
        raise _bad(f"the {fmt} file cannot be read: {exc}") from None
    seconds = info.frames / info.samplerate if info.samplerate > 0 and info.frames > 0 else 0.0
    if info.channels < 1 or info.samplerate <= 0:
        raise _bad(f"the {fmt} file names {info.channels} channels at {info.samplerate} Hz")
    if max_audio_s > 0 and seconds > max_audio_s:
        raise _bad(f"the audio is {seconds:.1f}s long; this server takes at most {max_audio_s:g}s "
                   "([server] max_audio_s)")
    return fmt, seconds


def decode_audio(data: bytes, rate: int, max_audio_s: float = 0.0) -> Any:
    """The file as float32 mono samples at `rate` (a numpy array); RequestRejected for a file that will not decode."""
    import numpy as np
    import soundfile as sf

    fmt, _ = check_audio(data, max_audio_s)
    try:
        samples, file_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # truncated or corrupt data past the header
        raise _bad(f"the {fmt} file cannot be decoded: {exc}") from None
    if samples.shape[0] == 0:
        raise _bad(f"the {fmt} file holds no audio samples")
    mono = samples.mean(axis=1)
    if max_audio_s > 0 and len(mono) / file_rate > max_audio_s:  # a header that understated the length
        raise _bad(f"the audio is {len(mono) / file_rate:.1f}s long; this server takes at most {max_audio_s:g}s")
    return resample(mono, file_rate, rate).astype(np.float32)


def resample(samples: Any, src: int, dst: int) -> Any:
    """Linear interpolation from `src` Hz to `dst` Hz (the identity when they are equal)."""
    import numpy as np

    if src == dst or len(samples) == 0:
        return samples
    n = max(1, round(len(samples) * dst / src))
    return np.interp(np.arange(n) * (src / dst), np.arange(len(samples)), samples)


def encode_audio(samples: Any, rate: int, response_format: str) -> bytes:
    """`samples` (float, -1..1, mono at `rate`) as `response_format` (see the module docstring)."""
    import numpy as np
    import soundfile as sf

    if response_format in REFUSED_FORMATS:
        raise _bad(REFUSED_FORMATS[response_format])
    if response_format not in RESPONSE_FORMATS:
        raise _bad(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}")
    clipped = np.clip(np.nan_to_num(np.asarray(samples, dtype=np.float32)), -1.0, 1.0)
    if response_format == "pcm":
        return (clipped * 32767).astype("<i2").tobytes()
    out = io.BytesIO()
    if response_format == "opus":
        sf.write(out, resample(clipped, rate, OPUS_RATE), OPUS_RATE, format="OGG", subtype="OPUS")
    else:
        fmt, subtype = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}[
            response_format]
        sf.write(out, clipped, rate, format=fmt, subtype=subtype)
    return out.getvalue()
