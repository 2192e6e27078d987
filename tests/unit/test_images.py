"""supervisor/gateway/images.py: image formats and sizes read from headers by hand, files cut short refused, the
limits, the order of images taken out of the messages, and URL fetching within its limits (a local HTTP server)."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from supervisor.errors import InvalidRequest
from supervisor.gateway.images import ImageLimits, check, fetch, sniff, take

Image = pytest.importorskip("PIL.Image", reason="Pillow makes the sample images")


def encoded(fmt: str, mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (37, 23)).save(out, fmt, **options)
    return out.getvalue()


SAMPLES = [  # (media type, bytes): every layout the header reader knows
    ("image/png", encoded("PNG")),
    ("image/jpeg", encoded("JPEG")),
    ("image/jpeg", encoded("JPEG", progressive=True)),
    ("image/webp", encoded("WEBP", lossless=True)),  # VP8L
    ("image/webp", encoded("WEBP")),  # VP8
    ("image/webp", encoded("WEBP", mode="RGBA")),  # VP8X
    ("image/gif", encoded("GIF")),
]


@pytest.mark.parametrize("media_type, data", SAMPLES)
def test_format_and_size_come_from_the_header_and_a_cut_file_is_refused(media_type: str, data: bytes) -> None:
    assert sniff(data, "x") == (media_type, (37, 23))
    with pytest.raises(InvalidRequest, match="truncated or corrupt"):
        sniff(data[:-3], "x")


def test_limits_and_media_types() -> None:
    png = encoded("PNG")
    assert check(png, "image/PNG", "x", ImageLimits()) == "image/png"
    for declared, limits, says in [("image/jpeg", ImageLimits(), "not the image/jpeg"),
                                   ("image/bmp", ImageLimits(), "not supported"),
                                   (None, ImageLimits(max_pixels=37 * 23 - 1), "37x23 pixels"),
                                   (None, ImageLimits(max_bytes=len(png) - 1), "larger than")]:
        with pytest.raises(InvalidRequest, match=says):
            check(png, declared, "x", limits)
    with pytest.raises(InvalidRequest, match="not PNG, JPEG, WebP or GIF"):
        sniff(b"II*\x00" + bytes(64), "x")



def gif(screen: tuple[int, int], *frames: tuple[int, int, int, int], palette: bool = True) -> bytes:
    """A GIF by hand: its logical screen and frames (left, top, width, height), each a few bytes of LZW data."""
    import struct

    out = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80 if palette else 0, 0, 0) + (bytes(6) if palette else b"")
    out += b"!\xf9\x04\x00\x00\x00\x00\x00"  # a graphic control extension, as animations carry before each frame
    for left, top, width, height in frames:
        out += b"," + struct.pack("<HHHHB", left, top, width, height, 0x80) + bytes(6)  # with a local palette
        out += b"\x02" + b"\x02\x44\x01" + b"\x00"  # LZW minimum code size, one data sub-block, its terminator
    return out + b";"


def test_a_gifs_frames_are_read_too_not_only_its_logical_screen() -> None:
    """A 1x1 screen with an 8000x8000 frame passed on to the worker (64M pixels, the limit 50M): the frames'
    image descriptors are read as well, and so is where a frame reaches (Pillow grows the canvas to hold it)."""
    many = Image.new("L", (37, 23))
    out = io.BytesIO()
    many.save(out, "GIF", save_all=True, append_images=[Image.new("L", (37, 23), 9)] * 3)
    assert check(out.getvalue(), "image/gif", "x", ImageLimits()) == "image/gif"  # Pillow's own animation
    assert check(gif((1, 1), (0, 0, 1, 1), (0, 0, 1, 1)), None, "x", ImageLimits()) == "image/gif"
    for frames in ([(0, 0, 1, 1), (0, 0, 8000, 8000)], [(7999, 7999, 1, 1)]):
        with pytest.raises(InvalidRequest, match="8000x8000 pixels, more than 50000000"):
            check(gif((1, 1), *frames, palette=False), None, "x", ImageLimits())
    with pytest.raises(InvalidRequest, match="truncated or corrupt"):
        check(gif((1, 1), (0, 0, 8000, 8000))[:-9] + b";", None, "x", ImageLimits())  # cut inside its frame

def test_images_are_taken_in_message_order_and_the_messages_given_stay_as_they_were() -> None:
    first, second = {"url": "a", "where": "0"}, {"url": "b", "where": "1"}
    messages = [{"role": "tool", "content": [{"type": "image", "source": first}]},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": second}]}]
    bare, sources = take(messages)
    assert sources == [first, second]
    assert bare[1]["content"] == [{"type": "text", "text": "hi"}, {"type": "image"}]
    assert messages[1]["content"][1]["source"] is second  # a stored Responses turn keeps its images


@pytest.fixture
def server() -> Iterator[str]:
    body = encoded("PNG")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/a.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="image-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()
    assert not thread.is_alive()


def test_a_url_is_fetched_within_its_byte_limit(server: str) -> None:
    limits = ImageLimits(fetch=True)
    assert asyncio.run(fetch(server + "/a.png", "x", limits)) == encoded("PNG")
    with pytest.raises(InvalidRequest, match="larger than"):
        asyncio.run(fetch(server + "/a.png", "x", ImageLimits(max_bytes=10, fetch=True)))
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        asyncio.run(fetch(server + "/missing.png", "x", limits))
