"""Vision through mlx-vlm (issue 29, first slice): the made VLM families load in mlx-vlm, and the batch engine's
greedy output for an image + prompt is mlx-vlm's own `generate`'s, alone and beside a text-only request.

Real MLX on CPU, real mlx-vlm model classes and processors, the worker's real engine in-process (no sockets: the
engine is what this slice adds; the gateway's image inputs come later). One tiny model per family, made once.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

from PIL import Image

from protocol.messages import Finished, Submit
from protocol.modelkind import VISION, model_kind
from worker.engine_api import RequestRejected

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
    """Every request to its end; the token ids each generated, from its chunks and its Finished."""
    for m in msgs:
        engine.submit(m)
    ids: dict[str, list[int]] = {m.rid: [] for m in msgs}
    while len(engine):
        engine.plan_step()
        chunks, ended = engine.step()
        for chunk in chunks:
            ids[chunk[0]] += chunk[3]
        for f in ended:
            assert isinstance(f, Finished), f
            ids[f.rid] += f.token_ids
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
    vlm, processor = engine.model.vlm, engine.prompts.processor
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


@pytest.mark.parametrize("image, says", [
    (["image/png", b"\x89PNG\r\n\x1a\n-truncated"], "could not be decoded"),
    (["image/tiff", b"II*\x00"], "media type"),
    (["image/png", "not bytes"], "[media_type, bytes]"),
])
def test_a_bad_image_is_refused_at_submit(engine, image: list, says: str) -> None:
    with pytest.raises(RequestRejected) as refused:
        engine.submit(Submit("bad", MAX_TOKENS, messages=QUESTION, temperature=0.0, images=[image]))
    assert says in str(refused.value)
    assert len(engine) == 0


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
    image_token = engine.prompts.images.image_token
    return max(i for i, t in enumerate(ids) if t == image_token) + 1


def image_start(engine, msg: Submit) -> int:
    return engine.tokenize(msg).index(engine.prompts.images.image_token)


def turn(rid: str, img: Image.Image, messages: list = TURN_TWO) -> Submit:
    return Submit(rid, MAX_TOKENS, messages=messages, temperature=0.0, images=[["image/png", png(img)]])


def test_a_second_turn_with_the_same_image_is_a_cache_hit_with_the_same_output(cached, engine) -> None:
    """The hit covers the image (the tower does not run again: its K/V came from the cache) and the answer, tokens
    and each logprob, is the uncached engine's: Qwen's rope delta after the image is right on a hit."""
    if engine.prompts.images.decoder.mrope != cached.prompts.images.decoder.mrope:
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
    prompts = engine.prompts
    limits = prompts.max_images, prompts.max_batch_pixels
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]
    big = Image.fromarray(np.zeros((512, 512, 3), dtype="uint8"))
    try:
        prompts.max_images = 1
        with pytest.raises(RequestRejected, match="at most 1 per request"):
            engine.submit(Submit("many", MAX_TOKENS, messages=two, images=[["image/png", png(picture(0))]] * 2))
        prompts.max_images, prompts.max_batch_pixels = 8, 512 * 512 + 64 * 64
        runs = engine.model.vlm.vision_tower.runs
        with pytest.raises(RequestRejected, match="pixels in all"):  # each fits, the two together do not
            engine.submit(Submit("burst", MAX_TOKENS, messages=two,
                                 images=[["image/png", png(big)], ["image/png", png(big)]]))
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
