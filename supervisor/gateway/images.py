"""Images in requests: each API's image part as the chat template's `{"type": "image"}` part, and its bytes,
checked, as Submit.images (docs/vision.md).

Two steps. Parsing (pure, in each API's *_api.py) turns an OpenAI `image_url` part, an Anthropic `image` block
or a Responses `input_image` into `image_part(source)`: `{"type": "image", "source": {...}}` where the source is
`{"url": ...}` (a data URL or http(s)) or `{"media_type", "data"}` (base64), plain JSON so the Responses store
can keep a turn's images for `previous_response_id`. Then `attach`, in each route once the model is known,
takes the sources out of the messages in their order (the worker pairs Submit.images with the parts in that
order), fetches http(s) URLs when `image_fetch` allows it, and checks every image before any worker sees it.

Checks, each a 400 (InvalidRequest, which each API writes in its own error body): a model that is not a vision
model; more than `image_max_count` images; bad base64 or a data URL that is not base64; a declared media type
outside FORMATS or one the bytes contradict; more than `image_max_bytes`; a header whose width x height passes
`image_max_pixels`; a file cut short. The format, the size and the completeness are read from the headers and
chunk structure by hand (`sniff`): no image is decoded here, so a 20,000 x 20,000 PNG costs a few bytes' reading,
and the supervisor needs no imaging library (Pillow is the worker's, where the image is decoded and re-checked).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protocol.modelkind import VISION
from supervisor.config import Settings
from supervisor.errors import InvalidRequest

if TYPE_CHECKING:
    from protocol.messages import Submit
    from supervisor.registry import Registry


class Parsed(Protocol):
    """What `attach` reads of a parsed request (openai_api.py's Parsed; named here so images.py imports no route
    module, which imports it)."""

    model: str
    submit: Submit
    choices: list[Submit]

FORMATS = ("image/png", "image/jpeg", "image/webp", "image/gif")
ALIASES = {"image/jpg": "image/jpeg"}
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
_GIF_BLOCK = re.compile(rb"[!,;]")  # the bytes that start a GIF block: an extension, a frame, the trailer
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20
    max_pixels: int = 50_000_000
    max_count: int = 8
    fetch: bool = False  # http(s) URLs fetched by the daemon (off: a 400 says so)
    fetch_timeout_s: float = 10.0

    @classmethod
    def of(cls, settings: Settings) -> ImageLimits:
        return cls(settings.image_max_bytes, settings.image_max_pixels, settings.image_max_count,
                   settings.image_fetch, settings.image_fetch_timeout_s)


def image_part(source: dict) -> dict:
    """The chat template's image part, holding its source until `attach` takes it out."""
    return {"type": "image", "source": source}


def content(parts: list[dict]) -> str | list[dict]:
    """A message's content from text and image parts: the joined text when there is no image (what a text
    model's template reads), else the parts in order, adjacent texts joined."""
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict] = []
    for p in parts:
        if p["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
        else:
            out.append(p)
    return out


def url_source(url: Any, where: str) -> dict:
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where} must be an image URL (a base64 data URL, or http(s) where allowed)", param=where)
    return {"url": url, "where": where}


def base64_source(media_type: Any, data: Any, where: str) -> dict:
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise InvalidRequest(f"{where}: a base64 image source needs string 'media_type' and 'data'", param=where)
    return {"media_type": media_type, "data": data, "where": where}


# --- attach: out of the messages, fetched, checked -------------------------------------------


def take(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the messages with each image part bare, the sources in order); the given messages are left as they
    are (a stored Responses turn keeps its images)."""
    out, sources = [], []
    for m in messages:
        parts = m.get("content")
        if isinstance(parts, list) and any(isinstance(p, dict) and "source" in p for p in parts):
            sources += [p["source"] for p in parts if isinstance(p, dict) and "source" in p]
            m = {**m, "content": [{"type": "image"} if isinstance(p, dict) and "source" in p else p for p in parts]}
        out.append(m)
    return out, sources


async def attach(parsed: Parsed, registry: Registry, limits: ImageLimits) -> None:
    """Each choice's Submit with its images as [media_type, bytes] and its messages' image parts bare; a 400
    for any image the model (`parsed.model`, a local one) cannot take (module docstring). A request without
    images is left as it is."""
    if parsed.submit.messages is None:
        return
    messages, sources = take(parsed.submit.messages)
    if not sources:
        return
    spec = registry.resolve(parsed.model)
    if spec.kind != VISION:
        raise InvalidRequest(f"'{spec.id}' is a {spec.kind} model: it reads no images (send text only, or ask a "
                             "vision model)", param=sources[0]["where"])
    if len(sources) > limits.max_count:
        raise InvalidRequest(f"{len(sources)} images in one request; at most {limits.max_count} are allowed "
                             "(server.image_max_count)", param=sources[limits.max_count]["where"])
    images = [await _image(source, limits) for source in sources]
    for submit in parsed.choices:
        submit.messages, submit.images = messages, images


async def _image(source: dict, limits: ImageLimits) -> list:
    """One source as [media_type, bytes], checked."""
    where, declared = source["where"], source.get("media_type")
    if "data" in source:
        data = _base64(source["data"], where, limits)
    elif (match := _DATA_URL.match(source["url"])) is not None:
        if "base64" not in match.group(2).lower().split(";"):
            raise InvalidRequest(f"{where}: a data URL image must be base64 (';base64,')", param=where)
        declared = match.group(1)
        data = _base64(source["url"][match.end():], where, limits)
    elif source["url"].lower().startswith(("http://", "https://")):
        if not limits.fetch:
            raise InvalidRequest(f"{where}: this server does not fetch image URLs (server.image_fetch is off): send "
                                 "the image inline, as base64", param=where)
        data = await fetch(source["url"], where, limits)
    else:
        raise InvalidRequest(f"{where}: an image URL must be a base64 data URL or http(s)", param=where)
    return [check(data, declared, where, limits), data]


def _base64(text: str, where: str, limits: ImageLimits) -> bytes:
    if len(text) * 3 // 4 > limits.max_bytes + 3:  # refused before it is decoded
        raise InvalidRequest(f"{where}: the image is larger than {limits.max_bytes} bytes (server.image_max_bytes)",
                             param=where)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the image data is not valid base64", param=where) from None


async def fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    """An image URL's bytes, within the time and byte limits (httpx2: the hub client's, already a dependency)."""
    import httpx2

    body = bytearray()
    try:
        async with asyncio.timeout(limits.fetch_timeout_s), \
                httpx2.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True, max_redirects=3) as client, \
                client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise InvalidRequest(f"{where}: fetching the image URL answered HTTP {resp.status_code}", param=where)
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise InvalidRequest(f"{where}: the image is larger than {limits.max_bytes} bytes "
                                         "(server.image_max_bytes)", param=where)
    except TimeoutError:
        raise InvalidRequest(f"{where}: fetching the image URL took longer than {limits.fetch_timeout_s:g}s",
                             param=where) from None
    except httpx2.HTTPError as exc:
        raise InvalidRequest(f"{where}: the image URL could not be fetched: {exc}", param=where) from None
    return bytes(body)


def check(data: bytes, declared: str | None, where: str, limits: ImageLimits) -> str:
    """The image's media type, read from its bytes; a 400 for a declared type it is not, a type outside
    FORMATS, too many bytes or pixels, or a file cut short."""
    declared = ALIASES.get(declared.lower(), declared.lower()) if declared else None
    if declared is not None and declared not in FORMATS:
        raise InvalidRequest(f"{where}: media type {declared!r} is not supported (one of {', '.join(FORMATS)})",
                             param=where)
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"{where}: the image is larger than {limits.max_bytes} bytes (server.image_max_bytes)",
                             param=where)
    media_type, size = sniff(data, where)
    if declared is not None and declared != media_type:
        raise InvalidRequest(f"{where}: the image's bytes are {media_type}, not the {declared} it is declared as",
                             param=where)
    width, height = size
    if width * height > limits.max_pixels:
        raise InvalidRequest(f"{where}: the image is {width}x{height} pixels, more than {limits.max_pixels} "
                             "(server.image_max_pixels)", param=where)
    return media_type


# --- headers, by hand ------------------------------------------------------------------------


def sniff(data: bytes, where: str) -> tuple[str, tuple[int, int]]:
    """(media type, (width, height)) from the magic bytes and the header; a 400 for anything else or a cut file."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            return "image/png", _png(data)
        if data.startswith(b"\xff\xd8\xff"):
            return "image/jpeg", _jpeg(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return "image/webp", _webp(data)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            if not data.rstrip(b"\x00").endswith(b";"):
                raise ValueError("no GIF trailer")
            return "image/gif", _gif(data)
    except (struct.error, IndexError, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image file is truncated or corrupt ({exc})", param=where) from None
    raise InvalidRequest(f"{where}: the image is not PNG, JPEG, WebP or GIF (by its first bytes)", param=where)


def _png(data: bytes) -> tuple[int, int]:
    """IHDR's size; the chunks walked (lengths only) to IEND, so a file cut short is seen without inflating it."""
    if data[12:16] != b"IHDR":
        raise ValueError("no IHDR chunk")
    width, height = struct.unpack(">II", data[16:24])
    at = 8
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        at += 12 + length
        if kind == b"IEND":
            if at > len(data):
                break
            return width, height
    raise ValueError("it ends before its IEND chunk")


def _jpeg(data: bytes) -> tuple[int, int]:
    """The frame header's size; the scan must end in EOI (0xFFD9 after the start of scan: inside the entropy-coded
    data a 0xFF is always stuffed, so the marker cannot appear by chance)."""
    at, size = 2, None
    while at < len(data):
        if data[at] != 0xFF:
            raise ValueError(f"no marker at byte {at}")
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2:at + 4])
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            size = (width, height)
        if marker == 0xDA:  # start of scan
            if size is None:
                raise ValueError("no frame header before the scan")
            if data.rfind(b"\xff\xd9", at + 2 + length) < 0:
                raise ValueError("no end-of-image marker")
            return size
        at += 2 + length
    raise ValueError("it ends before its scan")


def _gif(data: bytes) -> tuple[int, int]:
    """The canvas a decoder makes: the logical screen, grown to hold every frame (Pillow grows it to a frame that
    reaches past the screen), so a 1x1 screen cannot hide an 8000x8000 frame. Every frame's image descriptor is
    read and its data skipped sub-block by sub-block (lengths only, nothing inflated); a byte that starts no block
    is passed over, as Pillow's reader passes it. Bounded: at most 1024 + size/64 blocks (a GIF's sub-blocks hold
    up to 255 bytes; encoders write full ones), and a stray byte is found by a C scan, not a byte at a time."""
    width, height, flags = struct.unpack("<HHB", data[6:11])
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # past the global colour table
    steps = [1024 + len(data) // 64]
    while True:
        kind = data[at]
        if kind == 0x3B:  # the trailer
            return width, height
        if kind == 0x21:  # an extension: its label, then sub-blocks
            at = _gif_blocks(data, at + 2, steps)
        elif kind == 0x2C:  # an image descriptor: a frame
            left, top, w, h, flags = struct.unpack("<HHHHB", data[at + 1:at + 10])
            width, height = max(width, left + w), max(height, top + h)
            at += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # past its local colour table
            at = _gif_blocks(data, at + 1, steps)  # past the LZW minimum code size and the image data
        else:
            found = _GIF_BLOCK.search(data, at + 1)
            if found is None:
                raise ValueError("it ends before its trailer")
            at = found.start()


def _gif_blocks(data: bytes, at: int, steps: list[int]) -> int:
    """Past a run of data sub-blocks (a length byte, that many bytes; a zero length ends the run)."""
    while (length := data[at]) != 0:
        at += 1 + length
        steps[0] -= 1
        if steps[0] < 0:
            raise ValueError("its blocks are too many for its size (sub-blocks of a few bytes each)")
    return at + 1


def _webp(data: bytes) -> tuple[int, int]:
    (riff,) = struct.unpack("<I", data[4:8])
    if riff + 8 > len(data):
        raise ValueError(f"its RIFF header says {riff + 8} bytes, the file has {len(data)}")
    chunk = data[12:16]
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise ValueError("no VP8 frame header")
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            raise ValueError("no VP8L signature")
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise ValueError(f"unknown WebP chunk {chunk!r}")
