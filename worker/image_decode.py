"""A vision request's images, checked and decoded where they cannot silence the worker's loop (no MLX here).

A picture's decoding has no bound a header can show: a progressive JPEG is decoded scan by scan, each scan one more
pass over the whole picture, so a 311 KB file of 7000 x 7000 pixels whose last scan is repeated 300 times keeps
Pillow busy for over 30 s. Decoded on the loop's thread, that silenced the loop past the supervisor's hang timeout:
the worker was killed as hung, the request resumed on a new worker which decoded it again, and every other request
of the model failed with it. So:
- `check_images` runs on the loop's thread before anything is decoded, cheap and bounded: each entry's shape and
  media type, and a JPEG's scans counted by walking its segments (`jpeg_scans`: a real progressive JPEG has about
  10; more than `max_scans` is refused);
- `decode_images` (Pillow: the four formats the gateway takes, their pixels from the headers against the request's
  limit before any is decoded, then each decoded to RGB) runs on a thread of `Decodes`, which gives each request's
  decode a deadline. Pillow's decoders release the GIL, so the loop goes on stepping, reading and heartbeating
  meanwhile; a decode past its deadline is the request's refusal ("image N took longer than Xs to decode").

`Decodes` runs at most `workers` decodes at once, each on a thread of its own, the rest queued (their bytes only:
decoded pictures are held only by running decodes and the ones done, which the engine takes at its next turn). A
thread cannot be stopped: one past its deadline is left to end by itself ("stuck") and no longer takes a slot, so it
never holds up the queue; at most `max_stuck` may run, and while that many do, images are refused at once (and the
queued ones with them), saying why. The deadline counts from the decode's start, not from its time in the queue.

Invariant: every job started ends in exactly one outcome that `poll` hands back (its pictures, or the exception that
refuses it), unless it was dropped (`drop`: the client is gone), in which case none is.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import INVALID_REQUEST, OVERLOADED
from worker.engine_api import RequestRejected

log = logging.getLogger(__name__)

IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what Pillow may open (an MPO is opened as a JPEG): no other decoder runs
MAX_JPEG_SCANS = 64  # a real progressive JPEG has about 10 (libjpeg's default script: 10 for colour, 6 for grey)
MAX_JPEG_SEGMENTS = 10_000  # segments walked at most (real files hold tens): the walk's own cost stays bounded
DECODE_DEADLINE_S = 10.0  # a request's images' decode, from its start
DECODE_WORKERS = 2  # decodes running at once
MAX_STUCK = 2  # decode threads past their deadline that may still run; beyond, images are refused

_FILL = re.compile(rb"\xff+")  # a marker may be preceded by fill bytes
# the next marker after a scan's header: in entropy-coded data a 0xFF is followed by a stuffed 0x00 or is a restart
# marker (0xD0-0xD7), so the first 0xFF followed by anything else is the marker that ends the scan (searched in C)
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: markers without a length


def jpeg_scans(data: bytes, stop_after: int = MAX_JPEG_SCANS) -> int:
    """How many scans (SOS segments) a JPEG holds before its EOI, counting stops once past `stop_after`; 0 for
    bytes that are not a JPEG. Pure and cheap: it walks the segments by their lengths, jumps over each scan's
    entropy-coded data with one C search, and walks MAX_JPEG_SEGMENTS at most. A file it cannot follow ends the count
    there (Pillow says what is wrong with it)."""
    if not data.startswith(b"\xff\xd8"):
        return 0
    at, scans, segments, end = 2, 0, 0, len(data)
    while at + 1 < end and segments < MAX_JPEG_SEGMENTS:
        if data[at] != 0xFF:
            break
        fill = _FILL.match(data, at)
        assert fill is not None
        at = fill.end() - 1  # the last 0xFF of the run, the marker's first byte
        if at + 1 >= end:
            break
        marker = data[at + 1]
        segments += 1
        if marker == 0xD9:  # EOI
            break
        if marker in _STANDALONE:
            at += 2
            continue
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if length < 2:
            break
        at += 2 + length
        if marker == 0xDA:  # SOS: its header, then its entropy-coded data up to the next marker
            scans += 1
            if scans > stop_after:
                break
            found = _SCAN_END.search(data, at)
            if found is None:
                break
            at = found.start()
    return scans


def check_images(images: list, max_scans: int = MAX_JPEG_SCANS) -> None:
    """Submit.images before any is decoded: each `[media_type, bytes]`, of a type the worker takes, and a JPEG (by
    its bytes, whatever it is declared as: Pillow decodes by content) of at most `max_scans` scans (0: any number).
    Cheap and bounded, on the loop's thread; a RequestRejected names the first that fails."""
    for i, item in enumerate(images):
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[1], bytes)):
            raise RequestRejected(INVALID_REQUEST, f"image {i} is not [media_type, bytes]")
        media_type, data = item
        if media_type not in IMAGE_TYPES:
            raise RequestRejected(INVALID_REQUEST, f"image {i}: media type {media_type!r} is not one of "
                                                   f"{', '.join(IMAGE_TYPES)}")
        if max_scans and (scans := jpeg_scans(data, max_scans)) > max_scans:
            raise RequestRejected(INVALID_REQUEST, f"image {i} is a JPEG of more than {max_scans} scans (it has at "
                                                   f"least {scans}; a progressive JPEG has about 10, and each scan is "
                                                   f"another pass over the whole picture): refused before decoding")


def decode_images(images: list, max_pixels: int, on_image: Callable[[int], None] = lambda i: None) -> list:
    """Checked Submit.images as PIL images (RGB, a GIF's first frame): every header is read first, and their pixels
    together past `max_pixels` are refused with nothing decoded; then each is decoded, `on_image(i)` said before the
    i-th. A RequestRejected names the first that fails. Pillow's decoders release the GIL: a thread runs this."""
    from PIL import Image, UnidentifiedImageError

    errors = (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError)
    opened: list = []
    try:
        pixels = 0
        for i, (_, data) in enumerate(images):
            try:
                img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
            except errors as exc:
                raise RequestRejected(INVALID_REQUEST, f"image {i} could not be decoded: {exc}") from None
            opened.append(img)
            pixels += img.width * img.height
            if pixels > max_pixels:
                raise RequestRejected(INVALID_REQUEST, f"the images hold more than {max_pixels} pixels in all; "
                                                       f"this worker decodes at most that many per request")
        out = []
        for i, img in enumerate(opened):
            on_image(i)
            try:
                img.seek(0)
                out.append(img.convert("RGB"))
            except errors as exc:
                raise RequestRejected(INVALID_REQUEST, f"image {i} could not be decoded: {exc}") from None
        return out
    finally:
        for img in opened:
            img.close()


@dataclass(eq=False)
class Job:
    """One request's decode: what it runs and for whom; its thread writes `at`, `result` or `error`, then `done`."""

    rid: str
    payload: Any  # handed back with the outcome (the engine's Submit)
    work: Callable[[Callable[[int], None]], Any]  # given `on_image`, returns the pictures
    started: float = 0.0
    at: int = 0  # the image being decoded
    result: Any = None
    error: BaseException | None = None
    dropped: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Decodes:
    """Jobs on threads of their own, at most `workers` at once, each with a deadline (the module's docstring). Called
    from one thread (the loop's); its threads only run a job's work and signal its end."""

    def __init__(self, deadline_s: float = DECODE_DEADLINE_S, workers: int = DECODE_WORKERS,
                 max_stuck: int = MAX_STUCK, clock: Callable[[], float] = time.monotonic, what: str = "image") -> None:
        self.what = what  # what a job decodes, for the refusals: an image, or an audio model's file
        self.deadline_s = deadline_s
        self.workers = max(1, workers)
        self.max_stuck = max(1, max_stuck)
        self.clock = clock
        self._queued: list[Job] = []
        self._running: list[Job] = []
        self._stuck: list[Job] = []  # past their deadline, their threads still running
        self._ended: list[tuple[Job, Any]] = []  # outcomes not handed back yet
        self._changed = threading.Event()  # a job's thread ended
        self.timed_out = 0  # jobs that passed their deadline, since the start

    # --- what is in flight ---------------------------------------------------------------

    @property
    def rids(self) -> list[str]:
        """The requests whose outcome is still owed: queued, decoding, or ended and not yet handed back."""
        return [j.rid for j in (*self._queued, *self._running, *(j for j, _ in self._ended)) if not j.dropped]

    def __len__(self) -> int:
        return len(self.rids)

    def __contains__(self, rid: object) -> bool:
        return rid in self.rids

    @property
    def stuck(self) -> int:
        """Decode threads past their deadline still running (as of the last call)."""
        return len(self._stuck)

    # --- the loop's calls ----------------------------------------------------------------

    def start(self, rid: str, work: Callable[[Callable[[int], None]], Any], payload: Any = None) -> None:
        """Decode for `rid` (now, or once a running decode ends); a RequestRejected while `max_stuck` decodes past
        their deadline still run."""
        self._sweep()
        if len(self._stuck) >= self.max_stuck:
            raise RequestRejected(OVERLOADED, self._busy())
        self._queued.append(Job(rid, payload, work))
        self._fill()

    def drop(self, rid: str) -> bool:
        """Forget `rid`'s decode (its client is gone): no outcome will come; a running one's thread still ends by
        itself, and holds its slot until then or its deadline. False when there is none."""
        for job in (*self._queued, *self._running, *(j for j, _ in self._ended)):
            if job.rid == rid and not job.dropped:
                job.dropped = True
                self._queued = [j for j in self._queued if j is not job]
                self._ended = [(j, o) for j, o in self._ended if j is not job]
                return True
        return False

    def poll(self) -> list[tuple[Any, Any]]:
        """The decodes that ended since the last poll, in the order they ended: (payload, the pictures or the
        exception that refuses the request); a decode past its deadline ends here, refused."""
        self._changed.clear()  # before looking: a thread that ends after this wakes the next `wait`
        self._sweep()
        ended, self._ended = self._ended, []
        return [(job.payload, outcome) for job, outcome in ended]

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s`, less when a running decode's deadline comes first, for a decode to end."""
        if not self._running:
            return
        now = self.clock()
        due = min(j.started + self.deadline_s for j in self._running)
        self._changed.wait(max(0.0, min(timeout_s, due - now)))

    # --- inside ---------------------------------------------------------------------------

    def _busy(self) -> str:
        return (f"{len(self._stuck)} {self.what} decodes that passed their {self.deadline_s:g}s deadline are still running "
                f"in this worker; it decodes no more {self.what}s until one of them ends")

    def _sweep(self) -> None:
        """Running jobs that ended or passed their deadline leave their slots (their outcomes kept for `poll`),
        stuck threads that ended are forgotten, and queued jobs take the free slots."""
        now = self.clock()
        running = []
        for job in self._running:
            if job.done.is_set():
                if not job.dropped:
                    self._ended.append((job, job.error if job.error is not None else job.result))
            elif now - job.started > self.deadline_s:
                self.timed_out += 1
                self._stuck.append(job)
                log.warning("[vision] rid=%s image %d passed its decode deadline of %gs; its thread is left to end "
                            "(%d such running)", job.rid, job.at, self.deadline_s, len(self._stuck))
                if not job.dropped and self.what != "image":
                    self._ended.append((job, RequestRejected(INVALID_REQUEST, (
                        f"the {self.what} took longer than {self.deadline_s:g}s to decode; send it shorter or as WAV"))))
                elif not job.dropped:
                    self._ended.append((job, RequestRejected(INVALID_REQUEST, (
                        f"image {job.at} took longer than {self.deadline_s:g}s to decode (this worker gives a "
                        f"request's images {self.deadline_s:g}s in all: --image-decode-deadline-s); send it smaller "
                        f"or re-encoded, e.g. as a baseline JPEG or a PNG"))))
            else:
                running.append(job)
        self._running = running
        for job in [j for j in self._stuck if j.done.is_set()]:
            log.info("[vision] rid=%s a decode past its deadline ended after %.1fs", job.rid, now - job.started)
        self._stuck = [j for j in self._stuck if not j.done.is_set()]
        self._fill()

    def _fill(self) -> None:
        while self._queued and len(self._running) < self.workers:
            if len(self._stuck) >= self.max_stuck:  # no thread may start: the queued would wait for no bound
                for job in self._queued:
                    self._ended.append((job, RequestRejected(OVERLOADED, self._busy())))
                self._queued = []
                return
            job = self._queued.pop(0)
            job.started = self.clock()
            self._running.append(job)
            threading.Thread(target=self._run, args=(job,), name=f"image-decode {job.rid}", daemon=True).start()

    def _run(self, job: Job) -> None:
        def on_image(i: int) -> None:
            job.at = i

        try:
            job.result = job.work(on_image)
        except BaseException as exc:  # handed to the loop's thread, which answers the request with it
            job.error = exc
        finally:
            job.done.set()
            self._changed.set()
