"""The audio models on mlx-audio's classes: Whisper for speech to text, Kokoro for text to speech, each
behind worker/audio_engine.py's Transcriber or Speaker, and `load_engine`, which builds the engine for a folder.

Why mlx-audio (installed with --no-deps, the `audio` extra): one package serves both kinds (its STT has Whisper,
Parakeet and some twenty other families; its TTS Kokoro and a dozen more) with MLX only; mlx-whisper serves Whisper
alone and declares torch and numba, and kokoro-mlx needs misaki[en] (spaCy and its models).

Whisper: mlx-audio's `stt.load` (a Hugging Face or mlx-community checkpoint with its tokenizer and preprocessor
files) and its `generate` over one window (worker/audio_engine.py windows the file), with `sample_len` capped by
`max_window_tokens` when set (a random-weight model runs every window to its cap). Kokoro: mlx-audio's `tts.load`
and its model called on phonemes; the text is turned into phonemes by espeak-ng (Debian's, `espeak-ng --ipa`) where
it is installed, else by the model's vocabulary letter by letter (a random-weight model's tests need no G2P);
misaki, Kokoro's own G2P, needs spaCy and is not used.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from protocol.modelkind import TTS, model_kind
from worker.audio_engine import AudioEngine
from worker.image_decode import DECODE_DEADLINE_S

log = logging.getLogger(__name__)

G2P_TIMEOUT_S = 10.0
KOKORO_WINDOW = 510  # phonemes per call: Kokoro's context less its two pad tokens


def plain(value: Any) -> Any:
    """A result as msgpack-native values (mlx-audio's segments hold numpy and MLX scalars); a float that is not finite
    (a random-weight model's -inf log probability) as None, which JSON can carry."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bool | int | str) or value is None:
        return value
    if hasattr(value, "tolist"):
        return plain(value.tolist())
    return str(value)


class Whisper:
    """worker/audio_engine.py's Transcriber over mlx-audio's Whisper."""

    rate = 16000
    window_s = 30.0

    def __init__(self, path: Path, max_window_tokens: int = 0) -> None:
        from mlx_audio.stt.utils import load

        self.model = load(str(path))
        self.max_window_tokens = max_window_tokens

    def transcribe(self, samples: Any, task: str, language: str | None, prompt: str | None, temperature: float,
                   words: bool) -> dict:
        options: dict[str, Any] = {"sample_len": self.max_window_tokens} if self.max_window_tokens else {}
        out = self.model.generate(samples, language=language, task=task, temperature=temperature,
                                  word_timestamps=words, initial_prompt=prompt, condition_on_previous_text=False,
                                  verbose=None, **options)
        segments = [{k: plain(v) for k, v in s.items() if k != "seek"} for s in (out.segments or [])]
        return {"text": out.text, "language": out.language or language or "", "segments": segments}


def phonemes(text: str, vocab: dict[str, int]) -> str:
    """`text` as Kokoro's phonemes: espeak-ng's IPA (American English) where installed, else its letters that the
    vocabulary has; either way only symbols of the vocabulary."""
    espeak = shutil.which("espeak-ng")
    ipa = text
    if espeak is not None:
        done = subprocess.run([espeak, "-q", "--ipa", "-v", "en-us", text], capture_output=True, text=True,
                              timeout=G2P_TIMEOUT_S, check=False)
        ipa = " ".join(done.stdout.split()) if done.returncode == 0 else text
    return "".join(c for c in ipa.replace("\u02d0", "").replace("r", "\u0279") if c in vocab)[:KOKORO_WINDOW]


class Kokoro:
    """worker/audio_engine.py's Speaker over mlx-audio's Kokoro."""

    def __init__(self, path: Path) -> None:
        import mlx.core as mx
        from mlx_audio.tts.utils import load_model

        self.model = load_model(path)
        self.rate = int(json.loads((path / "config.json").read_text()).get("sample_rate", 24000))
        names = sorted(p.stem for p in (path / "voices").glob("*.safetensors"))
        if not names:
            raise ValueError(f"{path}/voices holds no voice pack (*.safetensors)")
        self.voices = sorted(names, key=lambda n: n != "af_heart")  # Kokoro's default voice first
        self.packs = {n: cast(Any, mx.load(str(path / "voices" / f"{n}.safetensors")))["voice"] for n in self.voices}

    def speak(self, text: str, voice: str, speed: float) -> Any:
        import numpy as np

        ps = phonemes(text, self.model.vocab)
        if not ps:
            return np.zeros(0, np.float32)
        import mlx.core as mx

        pack: Any = self.packs[voice]
        mx.random.seed(0)  # Kokoro's source adds noise: seeded, the same text speaks the same samples every time
        audio = self.model(ps, pack[min(len(ps), pack.shape[0]) - 1], speed)
        return np.array(audio, dtype=np.float32).reshape(-1)


def load_engine(path: Path, report: Callable[[str, float], None], max_window_tokens: int = 0,
                decode_deadline_s: float = DECODE_DEADLINE_S) -> AudioEngine:
    """The engine for an stt or tts folder (protocol/modelkind.py), its model loaded."""
    import mlx.core as mx

    from worker.mlx_engine.release import release

    started = time.perf_counter()
    report("weights", 0.0)
    speaks = model_kind(path) == TTS
    model: Whisper | Kokoro = Kokoro(path) if speaks else Whisper(path, max_window_tokens)
    report("weights", 1.0)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return AudioEngine(model, speaks=speaks, weights_bytes=weights, load_s=time.perf_counter() - started,
                       decode_deadline_s=decode_deadline_s, release=mx.clear_cache, unload=release)
