"""Vision through mlx-vlm (issue 29, first slice): the made VLM families load in mlx-vlm, and the batch engine's
greedy output for an image + prompt is mlx-vlm's own `generate`'s, alone and beside a text-only request.

Real MLX on CPU, real mlx-vlm model classes and processors, the worker's real engine in-process (no sockets: the
engine is what this slice adds; the gateway's image inputs come later). One tiny model per family, made once.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

from PIL import Image

from protocol.messages import INVALID_REQUEST, MODEL_EVICTED, Failed, Finished, Submit
from protocol.modelkind import VISION, model_kind
from tests.conftest import wait_for
from worker.engine_api import RequestRejected
from worker.shutdown import Shutdown

MAX_TOKENS = 10
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]}]
TEXT_ONLY = [{"role": "user", "content": "hello there"}]


def picture(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((64, 64, 3)) * 255).astype("uint8"))


def png(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from worker.mlx_engine.make_model import make_model

    paths = {arch: tmp_path_factory.mktemp(arch) for arch in ("qwen3_vl", "gemma3_vl")}
    for arch, path in paths.items():
        make_model(path, "tiny", arch=arch)
    return paths


@pytest.fixture(scope="module", params=["qwen3_vl", "gemma3_vl"])
def engine(request: pytest.FixtureRequest, made: dict[str, Path]):
    from worker.mlx_engine.vision import vision_engine

    eng = vision_engine(made[request.param], max_batch_size=4)
    yield eng
    eng.settle()


def run(engine, *msgs: Submit) -> dict[str, list[int]]:
    """Every request to its end (others in flight go on); the token ids each generated, from its chunks and its
    Finished."""
    for m in msgs:
        engine.submit(m)
    ids: dict[str, list[int]] = {m.rid: [] for m in msgs}
    while set(ids) & set(engine.rids):
        engine.plan_step()
        chunks, ended = engine.step()
        for chunk in chunks:
            ids.setdefault(chunk[0], []).extend(chunk[3])
        for f in ended:
            assert isinstance(f, Finished), f
            ids.setdefault(f.rid, []).extend(f.token_ids)
    return ids


def ask(rid: str, img: Image.Image) -> Submit:
    return Submit(rid, MAX_TOKENS, messages=QUESTION, temperature=0.0, images=[["image/png", png(img)]])


def reference(engine, img: Image.Image) -> tuple[list[int], list[float]]:
    """mlx-vlm's own greedy generation on the same model, image and prompt tokens: each token and its logprob."""
    from mlx_vlm import stream_generate

    text = engine.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    # mlx-vlm 0.7.10 tokenizes Gemma 3 prompts with special tokens (its Gemma3Processor never holds the chat
    # template), adding a second <bos>: hand it the prompt without the template's, so both see the same tokens
    text = text.removeprefix("<bos>")
    vlm, processor = engine.model.vlm, engine.vision.processor
    tokens, logprobs = [], []
    for out in stream_generate(vlm, processor, text, image=[img], max_tokens=MAX_TOKENS, temperature=0.0):
        tokens.append(out.token)
        logprobs.append(float(out.logprobs.reshape(-1)[out.token].item()))
    return tokens[:MAX_TOKENS], logprobs[:MAX_TOKENS]  # its last result repeats the last token, as a summary


def test_a_made_vision_model_is_recognised_by_its_files(made: dict[str, Path]) -> None:
    for path in made.values():
        assert model_kind(path) == VISION
    (made["qwen3_vl"] / "preprocessor_config.json").rename(made["qwen3_vl"] / "moved.json")
    try:  # the processor's files are part of what makes it one: without them, its folder serves text
        assert model_kind(made["qwen3_vl"]) != VISION
    finally:
        (made["qwen3_vl"] / "moved.json").rename(made["qwen3_vl"] / "preprocessor_config.json")


def test_greedy_output_for_an_image_is_mlx_vlms_alone_and_beside_a_text_request(engine) -> None:
    img = picture(0)
    expected, _ = reference(engine, img)
    assert len(expected) == MAX_TOKENS
    alone = run(engine, ask("alone", img))["alone"]  # the solo lane
    assert alone == expected
    text_alone = run(engine, Submit("text", MAX_TOKENS, messages=TEXT_ONLY, temperature=0.0))["text"]
    both = run(engine, ask("image", img), Submit("text", MAX_TOKENS, messages=TEXT_ONLY, temperature=0.0))
    assert both["image"] == alone  # the batch: its rows, its merge of the image's prefix cache
    assert both["text"] == text_alone and len(text_alone) == MAX_TOKENS


def test_each_tokens_logprob_is_mlx_vlms(engine) -> None:
    """Tokens alone can agree by luck on a random model; every step's logprob agrees only if every position does
    (Qwen's M-RoPE positions after the image, in the solo's cache and in a batch row's)."""
    img = picture(0)
    tokens, expected = reference(engine, img)
    msg = ask("scored", img)
    msg.logprobs = 0  # the batch path (a request with logprobs is never the solo)
    engine.submit(msg)
    got: list[float] = []
    while len(engine):
        engine.plan_step()
        chunks, ended = engine.step()
        for chunk in chunks:
            got += [entry[1] for entry in (chunk[4] if len(chunk) > 4 else {}).get("logprobs", [])]
        for f in ended:
            got += [entry[1] for entry in (f.extra or {}).get("logprobs", [])]
    assert len(got) == len(tokens)
    assert np.allclose(got, expected, atol=1e-4), (got, expected)


def test_the_image_decides_the_output(engine) -> None:
    """Guards the parity test's power: a different picture gives different tokens (the image is really read)."""
    outputs = run(engine, ask("first", picture(0)))["first"], run(engine, ask("second", picture(1)))["second"]
    assert outputs[0] != outputs[1]


def answered(engine, msg: Submit) -> Finished | Failed:
    """Submit a request and step until it is answered: its images decode off the loop, so a refusal found by the
    decode comes from a later step (one found before decoding is raised by submit)."""
    engine.submit(msg)
    ends: dict[str, Finished | Failed] = {}
    while msg.rid in engine.rids:
        engine.plan_step()
        ends.update((end.rid, end) for end in engine.step()[1])
    return ends[msg.rid]


def progressive_bomb(side: int, repeats: int) -> bytes:
    """A progressive JPEG whose last scan is repeated `repeats` times before its EOI: each copy is one more pass over
    the whole picture for the decoder (the issue's bomb: 7000 x 7000, 300 copies, 311 KB, over 30 s in Pillow)."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 80, 200)).save(out, "JPEG", progressive=True)
    data = out.getvalue()
    last, eoi = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:eoi] + data[last:eoi] * repeats + data[eoi:]


@pytest.mark.parametrize("image, says, at_submit", [
    (["image/png", b"\x89PNG\r\n\x1a\n-truncated"], "image 0 could not be decoded", False),  # by the decode
    (["image/tiff", b"II*\x00"], "media type", True),
    (["image/png", "not bytes"], "[media_type, bytes]", True),
    (["image/jpeg", progressive_bomb(64, 100)], "image 0 is a JPEG of more than 64 scans", True),
])
def test_a_bad_image_is_refused(engine, image: list, says: str, at_submit: bool) -> None:
    msg = Submit("bad", MAX_TOKENS, messages=QUESTION, temperature=0.0, images=[image])
    if at_submit:  # before anything is decoded
        with pytest.raises(RequestRejected) as refused:
            engine.submit(msg)
        assert says in str(refused.value)
    else:
        end = answered(engine, msg)
        assert isinstance(end, Failed) and end.code == INVALID_REQUEST and says in end.message, end
    assert len(engine) == 0 and not engine.rids


# --- decoding off the loop (issue 47): the loop goes on while a request's images decode -------------------------


class Held:
    """The engine's decode, held until released: it records the thread it ran on, then decodes for real."""

    def __init__(self, engine) -> None:
        self.real = engine.decode
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, images: list, max_pixels: int, on_image) -> list:
        self.threads.append(threading.current_thread())
        self.started.set()
        assert self.release.wait(30), "never released"
        return self.real(images, max_pixels, on_image)


@pytest.fixture
def held(engine):
    hold = Held(engine)
    engine.decode = hold
    deadline = engine.decodes.deadline_s
    yield hold
    hold.release.set()
    engine.decode, engine.decodes.deadline_s = hold.real, deadline
    for t in hold.threads:
        t.join(30)
        assert not t.is_alive()
    engine.decodes.poll()
    assert engine.decodes.stuck == 0 and len(engine) == 0


def test_an_image_decodes_off_the_loop_while_a_text_request_runs_to_its_end(engine, held: Held) -> None:
    """While an image request's decode is held, submit has returned, the request is in flight (len, rids, waiting),
    and a text request submitted after it is generated to its end; once the decode ends, the image request is
    admitted and answers as it does alone."""
    held.release.set()
    alone = run(engine, ask("alone", picture(0)))["alone"]
    held.release.clear()
    held.started.clear()
    engine.submit(ask("image", picture(0)))
    assert held.started.wait(30) and held.threads[-1] is not threading.current_thread()
    assert engine.rids == ["image"] and len(engine) == 1 and engine.waiting() == 1
    text = run(engine, Submit("text", MAX_TOKENS, messages=TEXT_ONLY, temperature=0.0))
    assert len(text["text"]) == MAX_TOKENS
    assert engine.rids == ["image"]  # still decoding: the text request ran to its end meanwhile
    held.release.set()
    ids: list[int] = []
    while len(engine):
        engine.plan_step()
        chunks, ended = engine.step()
        ids += [t for chunk in chunks for t in chunk[3]] + [t for f in ended for t in f.token_ids]
    assert ids == alone


def test_a_decode_past_its_deadline_is_an_invalid_request_and_the_engine_goes_on(engine, held: Held) -> None:
    engine.decodes.deadline_s = 0.05
    t0 = time.monotonic()
    end = answered(engine, ask("slow", picture(0)))
    assert isinstance(end, Failed) and end.code == INVALID_REQUEST, end
    assert end.message.startswith("image 0 took longer than 0.05s to decode"), end.message
    assert time.monotonic() - t0 < 20  # answered at its deadline, while the decode still runs
    assert held.threads[0].is_alive() and engine.decodes.stuck == 1
    assert len(run(engine, Submit("after", MAX_TOKENS, messages=TEXT_ONLY, temperature=0.0))["after"]) == MAX_TOKENS


def test_an_abort_drops_a_decoding_request_and_an_evict_fails_it(engine, held: Held) -> None:
    """Abort (the client is gone): nothing is ever sent for it. An evict (worker/shutdown.py, which knows the engine
    by len and fail_all) and a crash (the loop fails engine.rids) answer it as any request in flight."""
    engine.submit(ask("gone", picture(0)))
    assert engine.abort("gone") and not engine.abort("gone") and len(engine) == 0
    engine.submit(ask("evicted", picture(0)))
    with pytest.raises(RequestRejected, match="already in flight"):
        engine.submit(ask("evicted", picture(0)))
    assert engine.rids == ["evicted"]  # what the loop's fail_in_flight answers after a crash
    shutdown, sent = Shutdown(), []
    shutdown.on_evict("now", 0)
    assert not shutdown.keep_running(engine, sent.append)  # nothing left in flight: the exit may run
    assert [(f.rid, f.code) for f in sent] == [("evicted", MODEL_EVICTED)]
    held.release.set()
    for t in held.threads:
        t.join(30)
    engine.plan_step()
    assert engine.step() == ([], []) and len(engine) == 0  # neither the aborted nor the evicted one answers again


def test_a_slow_jpeg_past_a_tiny_deadline_is_refused_with_no_fake(engine) -> None:
    """A real picture under the scan limit whose decode takes far longer than the deadline."""
    deadline = engine.decodes.deadline_s
    engine.decodes.deadline_s = 0.01
    try:
        msg = Submit("jpeg", MAX_TOKENS, messages=QUESTION, temperature=0.0,
                     images=[["image/jpeg", progressive_bomb(3000, 50)]])  # 60 scans: ~0.4 s here
        end = answered(engine, msg)
    finally:
        engine.decodes.deadline_s = deadline
    assert isinstance(end, Failed) and end.message.startswith("image 0 took longer than 0.01s to decode"), end
    wait_for(lambda: engine.decodes.poll() == [] and engine.decodes.stuck == 0, 60, what="the decode's end")


# --- third slice: caches keyed by the image's pixels, the tower's output reused, the worker's own limits ----------

TURN_TWO = [*QUESTION, {"role": "assistant", "content": "It is noise."}, {"role": "user", "content": "And now?"}]


@pytest.fixture(scope="module", params=["qwen3_vl", "gemma3_vl"])
def cached(request: pytest.FixtureRequest, made: dict[str, Path]):
    """An engine with a hot prompt cache of small blocks, so the tiny prompts fill some; probe off: the plain fixture
    runs it."""
    from worker.mlx_engine.prompt_cache import CacheOptions
    from worker.mlx_engine.vision import vision_engine

    eng = vision_engine(made[request.param], max_batch_size=4, probe=False,
                        cache=CacheOptions(hot_bytes=64 * 2**20, block_tokens=8, snapshot_every=8))
    yield eng
    eng.settle()


def scored(engine, msg: Submit) -> tuple[list[int], list[float], int]:
    """One request to its end: its tokens, each one's logprob, and its usage's cached tokens."""
    msg.logprobs = 0
    engine.submit(msg)
    ids: list[int] = []
    logprobs: list[float] = []
    done: list[Finished] = []
    while len(engine):
        engine.plan_step()
        chunks, ended = engine.step()
        for chunk in chunks:
            ids += chunk[3]
            logprobs += [e[1] for e in (chunk[4] if len(chunk) > 4 else {}).get("logprobs", [])]
        for f in ended:
            assert isinstance(f, Finished), f
            ids += f.token_ids
            logprobs += [e[1] for e in (f.extra or {}).get("logprobs", [])]
            done.append(f)
    return ids, logprobs, done[0].cached_tokens


def image_end(engine, msg: Submit) -> int:
    """How many of the prompt's tokens run through its last image token."""
    ids = engine.tokenize(msg)
    image_token = engine.vision.image_token
    return max(i for i, t in enumerate(ids) if t == image_token) + 1


def image_start(engine, msg: Submit) -> int:
    return engine.tokenize(msg).index(engine.vision.image_token)


def turn(rid: str, img: Image.Image, messages: list = TURN_TWO) -> Submit:
    return Submit(rid, MAX_TOKENS, messages=messages, temperature=0.0, images=[["image/png", png(img)]])


def test_a_second_turn_with_the_same_image_is_a_cache_hit_with_the_same_output(cached, engine) -> None:
    """The hit covers the image (the tower does not run again: its K/V came from the cache) and the answer, tokens
    and each logprob, is the uncached engine's: Qwen's rope delta after the image is right on a hit."""
    if engine.vision.decoder.mrope != cached.vision.decoder.mrope:
        pytest.skip("one family at a time")  # the two module fixtures are parametrized independently
    img = picture(11)
    expected_ids, expected_lp, none = scored(engine, turn("plain", img))  # no prompt cache at all
    assert none == 0
    first = scored(cached, ask("first", img))
    assert first[2] == 0
    tower = cached.model.vlm.vision_tower
    runs = tower.runs
    ids, logprobs, hit = scored(cached, turn("second", img))
    assert hit >= image_end(cached, turn("x", img)), hit
    assert tower.runs == runs  # the image's K/V came from the cache: nothing encoded
    assert ids == expected_ids
    assert np.allclose(logprobs, expected_lp, atol=1e-4), (logprobs, expected_lp)
    again = scored(cached, turn("third", img))  # the whole second turn was kept: a hit on its blocks, same answer
    assert again[0] == expected_ids and again[2] >= hit


def test_a_different_image_at_the_same_place_is_a_miss(cached) -> None:
    scored(cached, ask("seen", picture(21)))
    other = turn("other", picture(22))
    ids, _, hit = scored(cached, other)
    assert hit <= image_start(cached, other), hit  # the text before the image at most
    assert ids == scored(cached, turn("other-again", picture(22)))[0]  # and its own entry answers the same


def test_the_towers_output_for_an_image_seen_before_is_reused(engine) -> None:
    """No prompt cache here: the second request prefills the image again, from the tower's kept output."""
    tower = engine.model.vlm.vision_tower
    img = picture(31)
    runs = tower.runs
    first = scored(engine, ask("once", img))
    assert tower.runs == runs + 1
    second = scored(engine, ask("twice", img))
    assert tower.runs == runs + 1  # not encoded again
    assert second[:2] == first[:2]
    scored(engine, ask("new", picture(32)))
    assert tower.runs == runs + 2  # a new image is encoded: the count is not stuck


def test_the_worker_limits_images_per_request_and_pixels_per_batch(engine) -> None:
    prompts = engine.vision
    limits = prompts.max_images, prompts.max_batch_pixels
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]
    big = Image.fromarray(np.zeros((512, 512, 3), dtype="uint8"))
    try:
        prompts.max_images = 1
        with pytest.raises(RequestRejected, match="at most 1 per request"):
            engine.submit(Submit("many", MAX_TOKENS, messages=two, images=[["image/png", png(picture(0))]] * 2))
        prompts.max_images, prompts.max_batch_pixels = 8, 512 * 512 + 64 * 64
        runs = engine.model.vlm.vision_tower.runs
        end = answered(engine, Submit("burst", MAX_TOKENS, messages=two,  # each fits, the two together do not
                                      images=[["image/png", png(big)], ["image/png", png(big)]]))
        assert isinstance(end, Failed) and "pixels in all" in end.message, end
        assert engine.model.vlm.vision_tower.runs == runs and len(engine) == 0  # refused before any work
        one = ask("one", big)
        assert scored(engine, one)[0]  # one of them alone is served
    finally:
        prompts.max_images, prompts.max_batch_pixels = limits


def test_admission_counts_the_vision_tower(engine, made: dict[str, Path]) -> None:
    """The weights admission counts (the folder's safetensors, engine.weights_bytes) hold every tensor of the tower."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder = next(p for p in made.values() if engine.weights_bytes == sum(
        f.stat().st_size for f in p.glob("*.safetensors")))
    stored = {k: v for f in folder.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    tower = {f"vision_tower.{k}": v for k, v in tree_flatten(engine.model.vlm.vision_tower.tower.parameters())}
    assert tower and all(k in stored and stored[k].shape == v.shape for k, v in tower.items())
