"""A request's own images cannot hang the loop and take the model down (issue 47): a daemon serving a tiny Qwen3-VL,
its worker decoding images off its loop with a deadline (worker/image_decode.py).

The issue's case: a 311 KB progressive JPEG of 7000 x 7000 pixels whose last scan is repeated 300 times was decoded
inside the generation loop for over 30 s; the supervisor killed the worker as hung, resumed the request on a new
worker which decoded it again and was killed again, and a text request to the same model got a 502. Here the bomb is
a 400 before anything decodes it (its scans are counted); a JPEG within the scan limit whose decode passes the
worker's deadline is a 400 too, while the decode's thread runs on; and the worker, its pid, and a text request sent
alongside are unaffected. The hang timeout (2 s) is shorter than the slow JPEG's decode (~3 s here), so a loop that
waited for it would be killed as hung.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

from PIL import Image

from tests.conftest import Daemon, start_daemon
from tests.integration.test_vision import picture, png

DEADLINE_S = 0.5  # the worker's image decode deadline here: a 64 x 64 picture decodes in well under a millisecond
PROMPT = "Describe this."


def progressive_bomb(side: int, repeats: int) -> bytes:
    """A progressive JPEG (10 scans) whose last scan is repeated `repeats` times before its EOI: each copy is one more
    pass over the whole picture, so the decode grows with `repeats` while the file barely does."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 80, 200)).save(out, "JPEG", progressive=True)
    data = out.getvalue()
    last, eoi = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:eoi] + data[last:eoi] * repeats + data[eoi:]


ISSUE_BOMB = progressive_bomb(7000, 300)  # the issue's: 311 KB, 310 scans, within every pixel and byte limit
SLOW = progressive_bomb(7000, 54)  # 64 scans, the limit: it passes the count, and decodes for ~3 s on this CPU


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from worker.mlx_engine.make_model import make_model

    root = tmp_path_factory.mktemp("vision-decode")
    make_model(root / "vl", "tiny", arch="qwen3_vl")
    config = root / "config.toml"
    config.write_text(f'[server]\nheartbeat_s = 0.2\nhang_timeout_s = 2.0\nhousekeeping_s = 0.1\n\n'
                      f'[models.vl]\npath = "{root / "vl"}"\n'
                      f'worker_args = ["--image-decode-deadline-s", "{DEADLINE_S}"]\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d
    assert d.stop() == 0


def chat(daemon: Daemon, image: tuple[str, bytes] | None = None, stream: bool = False) -> httpx.Response:
    content: list[dict] = [{"type": "text", "text": PROMPT}]
    if image is not None:
        url = f"data:{image[0]};base64,{base64.b64encode(image[1]).decode()}"
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = {"model": "vl", "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": content}]}
    return httpx.post(daemon.v1 + "/chat/completions", json=body, timeout=120)


def anthropic(daemon: Daemon, image: bytes) -> httpx.Response:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(image).decode()}}
    body = {"model": "vl", "max_tokens": 8, "messages": [{"role": "user", "content": [
        block, {"type": "text", "text": PROMPT}]}]}
    return httpx.post(daemon.url + "/v1/messages", json=body, timeout=120)


def served(daemon: Daemon) -> dict:
    """The worker as the supervisor sees it, after a text and an image request that both succeed."""
    text = chat(daemon)
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"], text.text
    image = chat(daemon, ("image/png", png(picture(0))))
    assert image.status_code == 200 and image.json()["choices"][0]["message"]["content"], image.text
    return daemon.model("vl")


def test_the_issues_scan_bomb_is_a_400_before_decoding_and_the_worker_stays(daemon: Daemon) -> None:
    before = served(daemon)
    assert len(ISSUE_BOMB) < 320_000 and ISSUE_BOMB.count(b"\xff\xda") == 310
    for stream in (False, True):  # streamed too: the error comes before the first token, as the response's status
        resp = chat(daemon, ("image/jpeg", ISSUE_BOMB), stream=stream)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_request", error
        assert "image 0 is a JPEG of more than 64 scans" in error["message"], error
    resp = anthropic(daemon, ISSUE_BOMB)
    assert resp.status_code == 400 and "more than 64 scans" in resp.json()["error"]["message"], resp.text
    after = served(daemon)
    assert after["pid"] == before["pid"] and after["restarts"] == 0 and after["crashes"] == 0, after


def test_a_decode_past_the_deadline_is_a_400_while_a_text_request_beside_it_succeeds(daemon: Daemon) -> None:
    """The slow JPEG's decode runs on a thread of the worker for ~3 s, longer than the supervisor's hang timeout; the
    request is refused at the worker's deadline, the text request sent alongside is answered, and so are the ones
    after it, by the same worker."""
    before = served(daemon)
    slow: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: slow.append(chat(daemon, ("image/jpeg", SLOW))), name="slow-image")
    thread.start()
    try:
        text = chat(daemon)
    finally:
        thread.join(120)
    assert not thread.is_alive()
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"], text.text
    (resp,) = slow
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_request", error
    assert error["message"].startswith(f"image 0 took longer than {DEADLINE_S:g}s to decode"), error
    after = served(daemon)  # while the refused decode's thread may still run: the loop never waited for it
    assert after["pid"] == before["pid"] and after["restarts"] == 0 and after["crashes"] == 0, after
    assert after["last_error"] is None, after
    log = (daemon.state_dir / "logs" / "worker-vl.log").read_text()
    assert "passed its decode deadline" in log

