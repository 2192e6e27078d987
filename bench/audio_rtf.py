"""Real-time factor of audio models (issue 54): transcription and synthesis through mlxsup against the same engine in
this process.

    python -m bench.audio_rtf --out bench/results/cpu/audio                     # the CPU box: a few minutes
    python -m bench.audio_rtf --seconds 30 --rounds 3 --out "$OUT/gpu/audio"    # the GPU host (bench/gpu_run.sh --)

The models: make-model's random-weight Whisper (`--whisper-preset`, default small: whisper-tiny's shape) and Kokoro
(tiny: Kokoro-82M's decoder, a narrower PL-BERT), or `--whisper DIR` / `--kokoro DIR`. Random weights never end a
window by themselves, so Whisper's windows are capped at `--window-tokens` on both sides (the cost of a window is
then the encoder's plus that many decoder steps: a real model's text is shorter or longer). The workload: a tone of
`--seconds` seconds (WAV, 16 kHz) transcribed, and `--text` spoken (WAV, 24 kHz). Real-time factor = compute
seconds / audio seconds (lower is faster); mlxsup's clock runs from the request's send to its whole reply, the
in-process one around worker/audio_engine.py's `transcribe_all` over the same Whisper class, and around Kokoro's
`speak`. Sides alternate A B, B A per round; the ratio is the median of the per-round ratios. Replies are checked
equal to the in-process ones (the text; the samples' count).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import machine, write_json
from bench.servers import Mlxsup

REPO = Path(__file__).resolve().parents[1]


def tone(seconds: float, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    sf.write(out, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def make(path: Path, arch: str, preset: str) -> Path:
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(path), "--arch", arch, "--preset",
                        preset], check=True, cwd=REPO)
    return path


async def run(args: argparse.Namespace) -> dict:
    import soundfile as sf

    from protocol.messages import Transcribe
    from worker.audio_codec import decode_audio
    from worker.audio_engine import transcribe_all
    from worker.mlx_engine.audio_models import Kokoro, Whisper

    root = args.work / "models"
    whisper_dir = (args.whisper or make(root / "whisper", "whisper", args.whisper_preset)).resolve()
    kokoro_dir = (args.kokoro or make(root / "kokoro", "kokoro", "tiny")).resolve()
    config = args.work / "config.toml"
    config.write_text(f'[models.whisper]\npath = "{whisper_dir}"\n'
                      f'worker_args = ["--max-window-tokens", "{args.window_tokens}"]\n\n'
                      f'[models.kokoro]\npath = "{kokoro_dir}"\n')
    whisper, kokoro = Whisper(whisper_dir, args.window_tokens), Kokoro(kokoro_dir)
    audio = tone(args.seconds)
    results: dict = {"command": "python -m bench.audio_rtf " + shlex.join(args.argv), "machine": machine(),
                     "platform": platform.platform(), "seconds": args.seconds, "text": args.text,
                     "window_tokens": args.window_tokens, "rounds": args.rounds, "whisper": str(whisper_dir),
                     "kokoro": str(kokoro_dir), "transcription": [], "synthesis": []}
    daemon = Mlxsup(root, args.work / "state", args=["--config", str(config)])
    try:
        await daemon.start()
        async with httpx.AsyncClient(timeout=1800, base_url=daemon.url) as http:
            for model_id in ("whisper", "kokoro"):
                await daemon.load(http, model_id)

            async def served_stt() -> tuple[float, str]:
                started = time.perf_counter()
                r = await http.post("/v1/audio/transcriptions", data={"model": "whisper", "language": "en"},
                                    files={"file": ("a.wav", audio, "audio/wav")})
                r.raise_for_status()
                return time.perf_counter() - started, r.json()["text"]

            def inproc_stt() -> tuple[float, str]:
                started = time.perf_counter()
                samples = decode_audio(audio, whisper.rate)
                reply = transcribe_all(whisper, samples, Transcribe("b", audio, language="en"))
                return time.perf_counter() - started, getattr(reply, "text", "")

            async def served_tts() -> tuple[float, int]:
                started = time.perf_counter()
                r = await http.post("/v1/audio/speech", json={"model": "kokoro", "input": args.text,
                                                              "response_format": "wav"})
                r.raise_for_status()
                return time.perf_counter() - started, len(sf.read(io.BytesIO(r.content))[0])

            def inproc_tts() -> tuple[float, int]:
                started = time.perf_counter()
                n = len(kokoro.speak(args.text, kokoro.voices[0], 1.0))
                return time.perf_counter() - started, n

            await served_stt()
            inproc_stt()  # both warmed once
            for r in range(args.rounds):
                order = ("mlxsup", "in_process") if r % 2 == 0 else ("in_process", "mlxsup")
                stt: dict = {"order": " ".join(order)}
                tts: dict = {"order": " ".join(order)}
                for side in order:
                    # in-process on this thread: MLX's streams are per thread (the daemon runs apart meanwhile)
                    stt[side] = await served_stt() if side == "mlxsup" else inproc_stt()
                    tts[side] = await served_tts() if side == "mlxsup" else inproc_tts()
                stt["same_text"] = stt["mlxsup"][1] == stt["in_process"][1]
                tts["same_samples"] = tts["mlxsup"][1] == tts["in_process"][1]
                speech_s = tts["in_process"][1] / kokoro.rate
                for row, audio_s in ((stt, args.seconds), (tts, speech_s)):
                    row["audio_s"] = round(audio_s, 3)
                    for side in ("mlxsup", "in_process"):
                        row[f"{side}_s"] = round(row[side][0], 3)
                        row[f"{side}_rtf"] = round(row[side][0] / max(audio_s, 1e-9), 3)
                        del row[side]
                results["transcription"].append(stt)
                results["synthesis"].append(tts)
                print(f"[audio] round={r} stt={stt} tts={tts}", file=sys.stderr, flush=True)
                write_json(args.out / "results.json", results)
            for kind in ("transcription", "synthesis"):
                rows = results[kind]
                results[f"{kind}_ratio"] = round(statistics.median(x["mlxsup_s"] / x["in_process_s"] for x in rows), 3)
                results[f"{kind}_rtf"] = {side: round(statistics.median(x[f"{side}_rtf"] for x in rows), 3)
                                          for side in ("mlxsup", "in_process")}
    finally:
        results["cleanup"] = await daemon.stop()
    results["all_processes_gone"] = all(v == "gone" for v in results["cleanup"]["pids"].values())
    write_json(args.out / "results.json", results)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.audio_rtf", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/mlxsup-bench-audio"),
                   help="where the models, the config and the daemon's state go (outside the tree)")
    p.add_argument("--whisper", type=Path, default=None)
    p.add_argument("--kokoro", type=Path, default=None)
    p.add_argument("--whisper-preset", default="small")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--text", default="Hello there.")
    p.add_argument("--window-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    args.argv = argv
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(args))
    print({k: results.get(k) for k in ("transcription_ratio", "transcription_rtf", "synthesis_ratio", "synthesis_rtf",
                                       "all_processes_gone")})
    return 0 if results["all_processes_gone"] else 1


if __name__ == "__main__":
    sys.exit(main())
