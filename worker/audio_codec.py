"""Audio files in and out of an audio model's worker, with soundfile (libsndfile 1.2) and numpy; no MLX.

`sniff` names a file's format from its first bytes, whatever content type the client claimed (a lying content type
changes nothing: the bytes decide); `check_audio` reads only the header (cheap, on the loop's thread): its format,
channels, rate and duration against the request's limit; `decode_audio` (on a thread of worker/image_decode.py's
`Decodes`, with a deadline: a file's decoding never runs on the loop's thread) decodes it whole to float32 mono at
the model's rate: channels averaged, other rates resampled linearly (np.interp). Formats: WAV, FLAC, MP3, OGG
(Vorbis or Opus); others (MP4/M4A, WebM) are refused, naming the ones taken. A malformed or truncated file is
refused with libsndfile's reason, as a file that decodes to no samples is.

`SpeechEncoder` writes a model's float samples as a response format, a piece at a time as synthesis makes them:
`write(samples)` returns the response's bytes that can be sent now, `close()` the rest, and the pieces' bytes in
order are the response, however the samples were cut into pieces (`encode_audio` is the same encoder fed once).
Formats: pcm (raw 16-bit little-endian at the model's rate) and wav (the same samples behind a 44-byte header whose
two sizes are 0xFFFFFFFF, "unknown": a stream's length is known only at its end; readers take the data to the end
of the file) stream sample for sample; mp3 streams frame by frame (LAME through libsndfile, at a constant bit rate,
so a reader that counts the frames from the stream's size, as libsndfile's does, reads it whole; its first frame is
LAME's tag frame left blank, a frame of silence, as the counts it would hold are known only at the end); opus (Ogg
Opus at the model's rate where Opus takes it, else resampled to 48 kHz a piece at a time) streams page by page, a
page at most OPUS_PAGE_MS of audio. flac does not stream: its STREAMINFO (length, MD5) is rewritten at the end and
libsndfile's own reader refuses a FLAC stream without it, so `close()` returns the whole file and `write` nothing.
AAC is refused: no encoder comes with the registries' packages (libsndfile has none).
"""

from __future__ import annotations

import io
import struct
from typing import Any

from protocol.messages import INVALID_REQUEST
from worker.engine_api import RequestRejected

FORMATS = ("WAV", "FLAC", "MP3", "OGG")  # what libsndfile may open here: nothing else is parsed
RESPONSE_FORMATS = ("wav", "flac", "mp3", "opus", "pcm")
REFUSED_FORMATS = {"aac": "no AAC encoder is available (libsndfile has none): ask for mp3, opus, flac, wav or pcm"}
OPUS_RATE = 48000  # Opus at a rate it does not take is resampled to this
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
OPUS_PAGE_MS = 100.0  # an Ogg page holds this much audio at most (libsndfile's default, 1000 ms, holds a stream back)
MP3_LEVEL = 0.5  # libsndfile's compression level for MP3: 80 kbps at 24 kHz, constant
SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h's command (soundfile names no constant for it)
STREAM_SIZE = 0xFFFFFFFF  # a WAV header's "unknown" size


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
    """`samples` (float, -1..1, mono at `rate`) as `response_format`: a SpeechEncoder's bytes for one piece."""
    encoder = SpeechEncoder(rate, response_format)
    return encoder.write(samples) + encoder.close()


def check_format(response_format: str) -> None:
    """RequestRejected for a response format that is not served, saying why."""
    if response_format in REFUSED_FORMATS:
        raise _bad(REFUSED_FORMATS[response_format])
    if response_format not in RESPONSE_FORMATS:
        raise _bad(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}")


def wav_header(rate: int, data_bytes: int = STREAM_SIZE) -> bytes:
    """A mono 16-bit PCM WAV header; sizes 0xFFFFFFFF unless the data's size is given."""
    riff = STREAM_SIZE if data_bytes == STREAM_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


class _Sink:
    """The file libsndfile writes into (its virtual I/O): bytes appended since the last `take` are the ones to send;
    what it rewrites before them at its close (a header's counts) is not sent again."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.at = 0
        self.sent = 0

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.data[self.at:self.at + len(chunk)] = chunk
        self.at += len(chunk)
        return len(chunk)

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.at + n
        chunk = bytes(self.data[self.at:end])
        self.at += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.at = offset if whence == io.SEEK_SET else self.at + offset if whence == io.SEEK_CUR else \
            len(self.data) + offset
        return self.at

    def tell(self) -> int:
        return self.at

    def take(self) -> bytes:
        chunk = bytes(self.data[self.sent:])
        self.sent = len(self.data)
        return chunk


class SpeechEncoder:
    """One response's speech, encoded a piece at a time (see the module docstring). Not thread-safe: one thread
    uses it at a time (worker/audio_engine.py's encoding thread)."""

    def __init__(self, rate: int, response_format: str) -> None:
        import soundfile as sf

        check_format(response_format)
        self.rate = rate
        self.format = response_format
        self.head = wav_header(rate) if response_format == "wav" else b""
        self.sink = _Sink()
        self.file: Any = None
        self.file_rate = rate if response_format != "opus" or rate in OPUS_RATES else OPUS_RATE
        if response_format == "opus":
            self.file = sf.SoundFile(self.sink, "w", self.file_rate, 1, format="OGG", subtype="OPUS")
            self._page_latency(OPUS_PAGE_MS)
        elif response_format == "mp3":
            self.file = sf.SoundFile(self.sink, "w", rate, 1, format="MP3", subtype="MPEG_LAYER_III",
                                     bitrate_mode="CONSTANT", compression_level=MP3_LEVEL)
        elif response_format == "flac":
            self.file = sf.SoundFile(self.sink, "w", rate, 1, format="FLAC", subtype="PCM_16")

    def _page_latency(self, ms: float) -> None:
        from soundfile import _ffi, _snd

        latency = _ffi.new("double*", ms)
        _snd.sf_command(self.file._file, SFC_SET_OGG_PAGE_LATENCY_MS, latency, _ffi.sizeof("double"))

    def write(self, samples: Any) -> bytes:
        """The next piece's samples (float, -1..1, mono at the model's rate); the bytes to send now."""
        import numpy as np

        clipped = np.clip(np.nan_to_num(np.asarray(samples, dtype=np.float32).reshape(-1)), -1.0, 1.0)
        if self.file is None:  # pcm, wav
            head, self.head = self.head, b""
            return head + np.rint(clipped * 32767).astype("<i2").tobytes()  # rounded, as libsndfile does
        if len(clipped):
            self.file.write(resample(clipped, self.rate, self.file_rate).astype(np.float32))
        return b"" if self.format == "flac" else self.sink.take()

    def close(self) -> bytes:
        """The response's last bytes (flac: the whole file); the encoder is done."""
        if self.file is None:
            head, self.head = self.head, b""
            return head
        self.file.close()
        return bytes(self.sink.data) if self.format == "flac" else self.sink.take()
