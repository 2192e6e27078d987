"""worker/image_decode.py (no MLX): a JPEG's scans counted from its segments (the pre-check that refuses a decoding
bomb before Pillow sees it), the checks and the decode of Submit.images, and `Decodes`: each request's decode on a
thread of its own with a deadline, a bounded number of them, dropped on an abort, refused while too many threads past
their deadline still run. The decode jobs here are fakes that block on events, on a fake clock: nothing sleeps."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from protocol.messages import INVALID_REQUEST, OVERLOADED
from worker.engine_api import RequestRejected
from worker.image_decode import MAX_JPEG_SCANS, Decodes, check_images, decode_images, jpeg_scans

Image = pytest.importorskip("PIL.Image", reason="Pillow makes the sample images")


def jpeg(side: int = 64, mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (side, side), 90).save(out, "JPEG", **options)
    return out.getvalue()


def bomb(data: bytes, repeats: int) -> bytes:
    """A progressive JPEG whose last scan (to the EOI) is repeated: libjpeg decodes each copy, another pass over the
    whole picture, so the decode's time grows with the count while the file barely does (the issue's 311 KB bomb:
    7000 x 7000 pixels, its last scan 300 times)."""
    last, eoi = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:eoi] + data[last:eoi] * repeats + data[eoi:]


def test_a_jpegs_scans_are_counted_from_its_segments() -> None:
    assert jpeg_scans(jpeg()) == 1  # baseline: one interleaved scan
    assert jpeg_scans(jpeg(progressive=True)) == 10  # libjpeg's progressive script for colour
    assert jpeg_scans(jpeg(mode="L", progressive=True)) == 6  # ... and for grey
    assert jpeg_scans(bomb(jpeg(progressive=True), 300), stop_after=10**6) == 310
    assert jpeg_scans(bomb(jpeg(progressive=True), 300)) == MAX_JPEG_SCANS + 1  # the count stops past its limit
    assert jpeg_scans(b"\x89PNG\r\n\x1a\n") == 0 and jpeg_scans(b"") == 0
    progressive = jpeg(progressive=True)
    assert jpeg_scans(progressive[:len(progressive) // 2]) < 10  # a file cut short: what it holds, no error


def test_scan_markers_inside_other_segments_or_scans_are_not_counted() -> None:
    """The walk follows segment lengths and skips each scan's entropy-coded data: an SOS marker's bytes in an APP
    segment (an EXIF thumbnail is a whole JPEG), restart markers and fill bytes are not scans."""
    plain = jpeg(progressive=True)
    thumbnail = jpeg(16)
    app1 = b"\xff\xe1" + (2 + len(thumbnail)).to_bytes(2, "big") + thumbnail
    assert jpeg_scans(plain[:2] + app1 + plain[2:]) == 10
    restarts = jpeg(256, restart_marker_blocks=1)
    assert restarts.count(b"\xff\xd0") > 1  # RST markers in the entropy-coded data
    assert jpeg_scans(restarts) == 1
    sos = plain.find(b"\xff\xda")
    assert jpeg_scans(plain[:sos] + b"\xff\xff\xff" + plain[sos:]) == 10  # fill bytes before a marker


def test_check_images_refuses_a_scan_bomb_before_decoding_and_says_why() -> None:
    bombed = bomb(jpeg(progressive=True), 100)
    for declared in ("image/jpeg", "image/png"):  # Pillow decodes by content: the declared type does not hide it
        with pytest.raises(RequestRejected, match=r"image 1 is a JPEG of more than 64 scans") as refused:
            check_images([["image/png", jpeg()], [declared, bombed]])
        assert refused.value.code == INVALID_REQUEST
    check_images([["image/jpeg", bombed]], max_scans=0)  # 0: not counted
    check_images([["image/jpeg", jpeg(progressive=True)], ["image/jpeg", jpeg()]])  # real files pass
    for item, says in [(["image/tiff", b"II*\x00"], "media type"), (["image/png", "text"], "[media_type, bytes]"),
                       ("image/png", "[media_type, bytes]")]:
        with pytest.raises(RequestRejected, match=says.replace("[", r"\[").replace("]", r"\]")):
            check_images([item])


def test_decode_images_reads_every_header_first_and_opens_only_the_four_formats() -> None:
    seen: list[int] = []
    pictures = decode_images([["image/jpeg", jpeg(8)], ["image/png", png(4)]], 1000, seen.append)
    assert [p.size for p in pictures] == [(8, 8), (4, 4)] and all(p.mode == "RGB" for p in pictures)
    assert seen == [0, 1]
    seen.clear()
    with pytest.raises(RequestRejected, match="more than 79 pixels in all"):
        decode_images([["image/png", png(4)], ["image/jpeg", jpeg(8)]], 79, seen.append)
    assert seen == []  # refused from the headers: nothing decoded
    tiff = io.BytesIO()
    Image.new("RGB", (4, 4)).save(tiff, "TIFF")
    with pytest.raises(RequestRejected, match="image 0 could not be decoded"):  # Pillow reads TIFF; the worker not
        decode_images([["image/png", tiff.getvalue()]], 1000)


def png(side: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side)).save(out, "PNG")
    return out.getvalue()


# --- Decodes ---------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Work:
    """A decode that reports image `at`, then blocks until released (or fails with `error`)."""

    def __init__(self, result: object = "pictures", at: int = 0) -> None:
        self.result, self.at = result, at
        self.release = threading.Event()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, on_image: Callable[[int], None]) -> object:
        self.thread = threading.current_thread()
        on_image(self.at)
        self.started.set()
        assert self.release.wait(30), "never released"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def works() -> Iterator[list[Work]]:
    made: list[Work] = []
    yield made
    for w in made:  # no thread outlives its test
        w.release.set()
        if w.thread is not None:
            w.thread.join(10)
            assert not w.thread.is_alive()


def ended(decodes: Decodes, n: int) -> list[tuple[object, object]]:
    """Poll until `n` decodes have ended (each poll after a decode's thread ended sees it: no sleeps)."""
    out: list[tuple[object, object]] = []
    deadline = time.monotonic() + 30
    while len(out) < n:
        assert time.monotonic() < deadline, out
        decodes.wait(1.0)
        out += decodes.poll()
    return out


def test_a_decode_runs_on_a_thread_of_its_own_and_its_outcome_comes_back_once(works: list[Work]) -> None:
    decodes = Decodes(deadline_s=5, workers=2, clock=Clock())
    a, b = Work("a-pictures"), Work()
    works += [a, b]
    decodes.start("a", a, payload="msg-a")
    decodes.start("b", b, payload="msg-b")
    assert a.started.wait(10) and b.started.wait(10)
    assert a.thread is not threading.current_thread() and a.thread is not b.thread
    assert decodes.rids == ["a", "b"] and len(decodes) == 2 and "a" in decodes
    assert decodes.poll() == []
    b.error = RequestRejected(INVALID_REQUEST, "image 0 could not be decoded: truncated")
    b.release.set()
    a.release.set()
    outcomes = dict(ended(decodes, 2))
    assert outcomes["msg-a"] == "a-pictures"
    assert isinstance(outcomes["msg-b"], RequestRejected) and "truncated" in str(outcomes["msg-b"])
    assert len(decodes) == 0 and decodes.poll() == []


def test_a_decode_past_its_deadline_is_refused_naming_the_image_and_its_thread_frees_its_slot(
        works: list[Work]) -> None:
    clock = Clock()
    decodes = Decodes(deadline_s=5, workers=1, max_stuck=2, clock=clock)
    slow, next_one = Work(at=2), Work("next")
    works += [slow, next_one]
    decodes.start("slow", slow, "msg-slow")
    decodes.start("next", next_one, "msg-next")  # queued: one worker
    assert slow.started.wait(10)
    clock.now += 4.9
    assert decodes.poll() == [] and not next_one.started.is_set()
    clock.now += 0.2
    ((payload, refusal),) = decodes.poll()
    assert payload == "msg-slow" and isinstance(refusal, RequestRejected) and refusal.code == INVALID_REQUEST
    assert str(refusal).startswith("image 2 took longer than 5s to decode")
    assert decodes.stuck == 1 and decodes.timed_out == 1
    assert next_one.started.wait(10)  # the stuck thread holds no slot: the queue goes on
    next_one.release.set()
    assert ended(decodes, 1) == [("msg-next", "next")]  # and its deadline counted from its own start
    slow.release.set()
    assert slow.thread is not None
    slow.thread.join(10)
    decodes.poll()
    assert decodes.stuck == 0 and len(decodes) == 0  # a stuck thread that ends is forgotten, with no outcome


def test_while_too_many_stuck_threads_run_images_are_refused_and_the_queue_with_them(works: list[Work]) -> None:
    clock = Clock()
    decodes = Decodes(deadline_s=1, workers=1, max_stuck=1, clock=clock)
    stuck, queued = Work(), Work()
    works += [stuck, queued]
    decodes.start("stuck", stuck, "msg-stuck")
    decodes.start("queued", queued, "msg-queued")
    assert stuck.started.wait(10)
    clock.now += 2
    outcomes = dict(decodes.poll())
    assert "took longer than 1s" in str(outcomes["msg-stuck"])
    busy = outcomes["msg-queued"]  # no thread may start for it: refused now, not left waiting without a bound
    assert isinstance(busy, RequestRejected) and busy.code == OVERLOADED
    assert "passed their 1s deadline are still running" in str(busy)
    assert not queued.started.is_set()
    with pytest.raises(RequestRejected, match="decodes no more images until one of them ends"):
        decodes.start("later", Work(), "msg-later")
    stuck.release.set()
    assert stuck.thread is not None
    stuck.thread.join(10)
    again = Work("again")
    works.append(again)
    decodes.start("again", again, "msg-again")  # the stuck thread ended: decoding resumes
    again.release.set()
    assert ended(decodes, 1) == [("msg-again", "again")]


def test_a_dropped_decode_gives_no_outcome_and_a_running_one_holds_its_slot_until_it_ends(works: list[Work]) -> None:
    decodes = Decodes(deadline_s=5, workers=1, clock=Clock())
    running, queued, last = Work(), Work(), Work("last")
    works += [running, queued, last]
    decodes.start("running", running, "msg-running")
    decodes.start("queued", queued, "msg-queued")
    decodes.start("last", last, "msg-last")
    assert running.started.wait(10)
    assert decodes.drop("queued") and decodes.drop("running")
    assert not decodes.drop("running") and not decodes.drop("unknown")
    assert decodes.rids == ["last"]
    assert decodes.poll() == [] and not last.started.is_set()  # the dropped decode still computes: its slot
    running.release.set()
    assert running.thread is not None
    running.thread.join(10)
    assert decodes.poll() == []  # it ended: no outcome for it, and the next queued one starts
    assert last.started.wait(10)
    assert not queued.started.is_set()
    last.release.set()
    assert ended(decodes, 1) == [("msg-last", "last")]


def test_wait_returns_when_a_decode_ends_or_its_deadline_comes(works: list[Work]) -> None:
    clock = Clock()
    decodes = Decodes(deadline_s=5, workers=1, clock=clock)
    decodes.wait(30)  # nothing running: at once
    w = Work()
    works.append(w)
    decodes.start("w", w, "msg")
    assert w.started.wait(10)
    clock.now += 6
    t0 = time.monotonic()
    decodes.wait(30)  # its deadline has come: at once, so the next poll refuses it
    assert time.monotonic() - t0 < 10
    clock.now -= 6
    w.release.set()
    decodes.wait(30)  # it ended: woken by its thread
    assert time.monotonic() - t0 < 10
    assert decodes.poll() == [("msg", "pictures")]
