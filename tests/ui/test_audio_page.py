"""The dashboard's audio part (issue 54) in a real headless Chromium: a WAV file transcribed by a Whisper worker shows
the API's own text, and text spoken by a Kokoro worker plays in the page's audio player (Chromium decodes it: its
duration is the speech's). Random-weight models from make-model, one daemon."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon
from tests.ui.test_dashboard import CHROMIUM_FLAGS, TIMEOUT_MS, chromium, playwright_api

pytest.importorskip("mlx_audio", reason="the audio extra (mlx-audio, installed with --no-deps) is not installed")
sf = pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def audio_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    root = tmp_path_factory.mktemp("audio-ui")
    for arch in ("whisper", "kokoro"):
        subprocess.run([*MLXSUP, "make-model", str(root / arch), "--arch", arch], check=True, capture_output=True)
    config = root / "config.toml"
    config.write_text(f'[models.whisper]\npath = "{root / "whisper"}"\nworker_args = ["--max-window-tokens", "8"]\n\n'
                      f'[models.kokoro]\npath = "{root / "kokoro"}"\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d, root
    assert d.stop() == 0


def test_a_file_is_transcribed_and_text_spoken_into_the_player(audio_daemon: tuple[Daemon, Path]) -> None:
    d, root = audio_daemon
    x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(8000) / 16000)).astype(np.float32)
    wav = root / "hello.wav"
    sf.write(wav, x, 16000, subtype="PCM_16")
    want = httpx.post(d.v1 + "/audio/transcriptions", data={"model": "whisper"}, timeout=600,
                      files={"file": ("hello.wav", wav.read_bytes(), "audio/wav")}).json()["text"]
    speech = httpx.post(d.v1 + "/audio/speech", json={"model": "kokoro", "input": "Hi.", "response_format": "wav"},
                        timeout=600)
    seconds = len(sf.read(io.BytesIO(speech.content))[0]) / 24000
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS * 10)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(d.url + "/ui")
        playwright_api.expect(page.locator('#stt-model option[value="whisper"]')).to_have_count(1)
        playwright_api.expect(page.locator('#tts-model option[value="kokoro"]')).to_have_count(1)
        assert page.locator('#play-model option[value="whisper"]').count() == 0  # the chat playground offers none
        page.set_input_files("#stt-file", str(wav))
        page.click("#stt-send")
        playwright_api.expect(page.locator("#audio-status")).to_have_attribute("data-done", "true",
                                                                               timeout=TIMEOUT_MS * 10)
        playwright_api.expect(page.locator("#audio-status")).to_have_text("transcribed")
        assert page.locator("#stt-output").inner_text() == want.strip() or \
            page.locator("#stt-output").text_content() == want
        page.fill("#tts-input", "Hi.")
        page.click("#tts-send")
        playwright_api.expect(page.locator("#audio-status")).to_have_text("spoken", timeout=TIMEOUT_MS * 10)
        page.wait_for_function("document.getElementById('tts-audio').duration > 0")
        duration = page.evaluate("document.getElementById('tts-audio').duration")
        assert abs(duration - seconds) < 0.05, (duration, seconds)
        browser.close()
        assert not errors, errors
