"""A vision-language model served by the batch engine: mlx-vlm's model classes and processor, mlx-lm's batch.

`vision_engine` builds the ordinary Engine (engine.py) on an mlx-vlm model and gives its constructor one composed part,
`VisionInput` (the engine's `vision`), which the engine's request path (request.py) and start (`_start`) call:
- `encode`: a chat request with images is rendered by the chat template (an image part as the family's placeholder;
  messages and tools shaped as a text request's, `template_input`), then the model's processor expands each
  placeholder to the image's tokens and turns the image into pixels (a `Processed`, which the EngineRequest
  carries); requests without images encode exactly as a text model's do, without it.
- `prefill`: the prompt's head, through its last image token, is prefilled here, outside the batch, from the merged
  embeddings (`get_input_embeddings`: text embeddings with the vision tower's features scattered over the image
  tokens; Qwen3-VL's deepstack features and M-RoPE positions with it); the request then joins the batch (or the solo
  lane) with that cache as its prefix, like a prompt-cache hit, and the rest of its prompt and all of its decoding
  are plain tokens.

`VisionDecoder` is what the batch calls: mlx-vlm's language model behind mlx-lm's model interface (tokens and a
cache in, logits out; `make_cache` with mlx-lm's cache classes, which batch). Qwen3-VL places tokens by M-RoPE:
after an image, a token's position is its index plus the prompt's `rope_delta` (negative: an image's tokens span
fewer positions than their count). A request's delta rides in its cache: `RopeKVCache.rope_delta` alone, and in
the batch the row's `offset` (mlx-lm's BatchKVCache reads `offset` for positions only; masks use its index and
padding), so it survives the generator's merge, filter and extend without the generator knowing.

Caches keyed by image: every image's placeholder ids are the same, so the prompt caches know a prompt by its `keys`
(`VisionInput.keys`, the EngineRequest's `keys`): its ids with each image's run of placeholders replaced by ids drawn from a hash of the
pixels the processor fed the model (vision_cache.py's `image_keys`; ids past any vocabulary: no text collides). The
same image in a later turn is a hit, a different one at the same place a miss. A hit that covers the images needs no
vision work at all; Qwen's rope delta, a function of the images before it, is recomputed from the prompt
(`get_rope_index`, no tower) rather than stored, so both tiers' blocks resume with the right positions. A hit that
ends before (or inside) the images continues the image prefill from it. `CachedTower` keeps the vision tower's
output per image (same hash) in a byte-bounded LRU, so an image seen before is not encoded again.

Decoding off the loop (`VisionEngine`, worker/image_decode.py): a picture's decode has no bound its header shows (a
progressive JPEG is decoded scan by scan, each a pass over the whole picture), so `submit` only checks a request's
images (cheap, bounded: shapes, media types, a JPEG's scans counted) and starts their decode on a thread with a
deadline (`decode_deadline_s`); the loop goes on stepping, reading and heartbeating. The turn after the decode ends,
`plan_step` admits the request as `submit` did before (template, processor, image prefill, on the loop's thread);
a decode past its deadline, or an image that does not decode, is the request's Failed(invalid_request), answered by
the next `step`. A request decoding is in flight: `len`, `rids`, `abort` and `fail_all` (an evict, a crash) know it.

Memory: a request holds at most `max_images` images of at most `max_batch_pixels` decoded pixels in all (checked
from the headers, before decoding); at most DECODE_WORKERS requests decode at once (and MAX_STUCK threads past their
deadline still run), and a request's image prefill runs in `plan_step`, one request at a time, so that is also the
most any burst holds at once: later requests wait in the decode queue (their bytes only). At load, one image of the
processor's largest size goes through the whole path (`probe_working_memory`): its peak stays in MLX's buffer cache,
so the footprint the worker reports at Ready, which admission counts, already holds an image's working memory.

Invariants: greedy output is mlx-vlm's own `generate`'s for the same model, image and prompt (the parity test),
from a cache hit too; an image that does not decode, one over the limits, or a count of images that is not the
prompt's, is a RequestRejected at submit or the request's one Failed(invalid_request) once its decode ends, never a
failure inside the step; every Submit with images is answered exactly once (admitted, or Failed), unless aborted.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from protocol.messages import INTERNAL_ERROR, INVALID_REQUEST, Failed, Finished, Submit
from worker.engine_api import RequestRejected
from worker.image_decode import (
    DECODE_DEADLINE_S,
    MAX_JPEG_SCANS,
    Decodes,
    check_images,
    decode_images,
)
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.prompt import Prompts
from worker.mlx_engine.prompt_cache import PromptCaches
from worker.mlx_engine.vision_cache import TOWER_CACHE_BYTES, CachedTower, image_hashes, image_keys
from worker.step_cost import StepPlan
from worker.template_input import chat_template_args

log = logging.getLogger(__name__)

MAX_IMAGES = 8  # per request, as the gateway's image_max_count default
MAX_BATCH_PIXELS = 50_000_000  # decoded pixels per request (one image prefill at a time), the gateway's per image
DECODE_POLL_S = 0.02  # with nothing to generate, a step waits this long at most for a decode to end
NOTHING = StepPlan(chunk=0, decoding=0, in_flight=0, prefill_tokens=0, attention=0.0, predicted_s=0.0)


class RopeKVCache(KVCache):
    """A KVCache whose positions run `rope_delta` from its index (Qwen's M-RoPE after an image)."""

    rope_delta = 0
    kv_blocks = True  # the prompt caches cut it into blocks as a KVCache (layer_state.py): its K carry the positions

    @classmethod
    def merge(cls, caches: list) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        batch.offset = batch.offset + mx.array([getattr(c, "rope_delta", 0) for c in caches])
        return batch


class VisionDecoder(nn.Module):
    """mlx-vlm's language model as mlx-lm's batch and solo lane call a model: `(tokens, cache) -> logits`."""

    def __init__(self, vlm: nn.Module) -> None:
        super().__init__()
        self.vlm = vlm
        self.mrope = hasattr(vlm.language_model, "get_rope_index")  # Qwen-VL: positions are passed explicitly

    @property
    def layers(self) -> list:
        return self.vlm.language_model.layers

    def make_cache(self) -> list:
        """mlx-lm's cache classes (they batch): Gemma 3's sliding layers rotate, as mlx-vlm's own caches do."""
        lm = self.vlm.language_model
        config = getattr(lm, "config", None)
        pattern = getattr(config, "sliding_window_pattern", 0)
        if config is not None and pattern:
            return [KVCache() if i % pattern == pattern - 1 else RotatingKVCache(max_size=config.sliding_window, keep=0)
                    for i in range(len(self.layers))]
        return [RopeKVCache() for _ in self.layers]

    def adopt(self, cache: list, rope_delta: int = 0) -> list:
        """A prefix from the prompt caches (plain KVCache layers) in this model's cache classes: Qwen's carry the
        delta, and every row of a batch must be a RopeKVCache for its merge to keep theirs."""
        if not self.mrope:
            return cache
        out = []
        for c in cache:
            r = RopeKVCache()
            r.keys, r.values, r.offset, r.rope_delta = c.keys, c.values, c.offset, rope_delta
            out.append(r)
        return out

    def positions(self, cache: list | None, batch: int, length: int) -> mx.array:
        """M-RoPE position ids (3, B, L) for tokens after the cache's: the three axes agree on text."""
        c0 = cache[0] if cache else None
        if c0 is None:
            base = mx.zeros((batch, 1), dtype=mx.int32)
        elif isinstance(c0.offset, mx.array) and c0.offset.ndim:
            base = c0.offset.reshape(-1, 1)  # a batch row's offset carries its delta (RopeKVCache.merge)
        else:
            base = mx.array([[c0.offset + getattr(c0, "rope_delta", 0)]])
        ids = base + mx.arange(length)[None]
        return mx.broadcast_to(ids[None], (3, batch, length))

    def __call__(self, inputs: mx.array, cache: list | None = None, **_: Any) -> mx.array:
        kwargs = {"position_ids": self.positions(cache, *inputs.shape)} if self.mrope else {}
        return self.vlm.language_model(inputs, cache=cache, **kwargs).logits


@dataclass(slots=True)
class Processed:
    """A prompt with images, as the processor made it: the ids (each image's tokens expanded) and the model's inputs."""

    ids: list[int]
    pixel_values: mx.array
    extra: dict  # image_grid_thw (Qwen), the attention mask, ...
    keys: list[int] = field(default_factory=list)  # the ids the prompt caches know it by (image_keys)
    heads: list[int] = field(default_factory=list)  # where sibling sessions branch (Prompts.branch_ends): snapshot points


class VisionInput:
    """The engine's vision part (given to its constructor): a chat request's images turned into its prompt (`encode`:
    rendered, then expanded and read by the processor), the ids the prompt caches know it by (`keys`), and its head
    through the last image token prefilled from the merged embeddings into a fresh cache (`prefill`)."""

    def __init__(self, vlm: nn.Module, decoder: VisionDecoder, processor: Any, image_token: int, prompts: Prompts,
                 max_images: int = MAX_IMAGES, max_batch_pixels: int = MAX_BATCH_PIXELS,
                 jpeg_max_scans: int = MAX_JPEG_SCANS) -> None:
        self.vlm = vlm
        self.decoder = decoder
        self.processor = processor
        self.image_token = image_token
        self.prompts = prompts  # the engine's: the template's rendering, a prompt's branch ends
        self.max_images = max_images
        self.max_batch_pixels = max_batch_pixels
        self.jpeg_max_scans = jpeg_max_scans  # 0: a JPEG's scans are not counted
        self.caches: PromptCaches | None = None  # the engine's, where it has them: snapshots inside the image prefix

    def check(self, msg: Submit) -> None:
        """What is refused before any image is decoded (cheap and bounded: on the loop's thread)."""
        if msg.messages is None:
            raise RequestRejected(INVALID_REQUEST, "images go with chat messages, not with a completion prompt")
        if len(msg.images) > self.max_images:
            raise RequestRejected(INVALID_REQUEST, f"{len(msg.images)} images sent; this worker takes at most "
                                                   f"{self.max_images} per request")
        check_images(msg.images, self.jpeg_max_scans)

    def encode(self, msg: Submit, pictures: list | None = None) -> Processed:
        """A chat request with images as the model takes it (`pictures`: decoded off the loop's thread, VisionEngine;
        None: a direct caller's, the load's probe or a test's, checked and decoded here, on this thread)."""
        if pictures is None:
            self.check(msg)
            pictures = decode_images(msg.images, self.max_batch_pixels)
        messages = msg.messages
        assert messages is not None  # check() refused the request otherwise
        try:
            shown, tools = self.prompts.shaped(messages, msg.tools)
            text = self.prompts.tokenizer.apply_chat_template(
                shown, tools=tools, tokenize=False, **chat_template_args(messages, msg.template_kwargs))
        except Exception as exc:  # a template can reject roles or shapes it does not know
            raise RequestRejected(INVALID_REQUEST, f"chat template rejected the messages: {exc}") from None
        try:
            inputs = self.processor(text=[text], images=pictures, add_special_tokens=False)
        except ValueError as exc:  # the processor's own check: placeholders and images disagree
            raise RequestRejected(INVALID_REQUEST, f"the images do not fit the prompt: {exc}") from None
        ids = [int(t) for t in inputs["input_ids"].reshape(-1).tolist()]
        if self.image_token not in ids:
            raise RequestRejected(INVALID_REQUEST, f"{len(pictures)} image(s) sent, but no message part places one")
        extra = {k: inputs[k] for k in ("image_grid_thw", "attention_mask") if k in inputs}
        if "attention_mask" in extra:
            extra["mask"] = extra.pop("attention_mask")
        hashes = image_hashes(inputs["pixel_values"], extra.get("image_grid_thw"), len(pictures))
        heads = self.prompts.branch_ends(msg, ids) if self.caches is not None and self.caches.layout.snapshots else []
        return Processed(ids, inputs["pixel_values"], extra, image_keys(ids, self.image_token, hashes), heads)

    @staticmethod
    def keys(processed: Processed, tokens: list[int]) -> list[int]:
        """The ids the prompt caches know a request by: its images keyed by their pixels, then the rest of `tokens`."""
        return [*processed.keys, *tokens[len(processed.ids):]]

    def prefill(self, rid: str, tokens: list[int], cached: int, prefix: list | None,
                processed: Processed | None) -> tuple[int, list, int] | None:
        """(tokens in the starting cache, it, how many came from the prompt caches) for a request (`processed`: its
        prompt with images; None: a text request's); `cached` tokens of it were found in the prompt caches (`prefix`,
        plain layers). None: the caches' own, as they are."""
        if processed is None:
            return None if prefix is None else (cached, self.decoder.adopt(prefix), cached)  # text: no delta
        ids = mx.array(processed.ids)[None]
        last = max(i for i, t in enumerate(processed.ids) if t == self.image_token)
        n = min(last + 1, len(processed.ids) - 1)  # the prompt's last token is the batch's: its first decode input
        if prefix is not None and cached >= n:  # the images' K/V were cached: nothing to encode or prefill
            delta = 0
            if self.decoder.mrope:
                grid, mask = processed.extra.get("image_grid_thw"), processed.extra.get("mask")
                delta = int(self.vlm.language_model.get_rope_index(ids, grid, None, mask)[1].reshape(-1)[0].item())
            return cached, self.decoder.adopt(prefix, delta), cached
        if prefix is None:
            cached = 0
        t0 = time.perf_counter()
        features = self.vlm.get_input_embeddings(ids, processed.pixel_values, **processed.extra)
        extra = {k: v for k, v in features.to_dict().items() if v is not None and k in (
            "position_ids", "visual_pos_masks", "deepstack_visual_embeds")}
        if "position_ids" in extra:
            extra["position_ids"] = extra["position_ids"][..., :n]
        if "visual_pos_masks" in extra:
            extra["visual_pos_masks"] = extra["visual_pos_masks"][:, :n]
        # from a cached head (it ends before the images or inside them): mlx-vlm aligns the whole prompt's
        # positions, visual mask and deepstack rows to the cache's offset
        cache = self.decoder.make_cache() if prefix is None else self.decoder.adopt(prefix)
        # a model with snapshot layers (Gemma 3's sliding ones) stops at the snapshot points inside this prefix, the
        # batch's only see the rest: the prefix through the point is stored now (Qwen's layout has none: one call).
        # The head (before the first user turn's text, so before its images) is one: sibling sessions branch there
        points = [p for p in self.caches.snapshot_points(len(tokens), cached, self.caches.matched, processed.heads)
                  if p <= n] if self.caches else []
        start = cached
        for end in sorted({*points, n}):
            self.vlm.language_model(ids[:, start:end], inputs_embeds=features.inputs_embeds[:, start:end],
                                    cache=cache, **extra)
            if end in points:
                self._store(processed.keys[:end], cache)
            start = end
        mx.eval([c.state for c in cache])
        if features.rope_deltas is not None:
            for c in cache:
                c.rope_delta = int(features.rope_deltas.reshape(-1)[0].item())
        log.debug("[vision] rid=%s prefix=%d cached=%d tokens=%d ms=%d", rid, n, cached, len(processed.ids),
                  (time.perf_counter() - t0) * 1e3)
        return n, cache, cached

    def _store(self, keys: list[int], cache: list) -> None:
        """Keep the image prefix's blocks through a snapshot point (the cache holds exactly `keys`), as the engine
        keeps a prompt's at the end of its request; a cache failure costs only the hit."""
        caches = cast(PromptCaches, self.caches)
        try:
            caches.store(keys, cache, {len(keys) // caches.block - 1: caches.snapshot(cache)})
        except Exception:
            log.exception("[cache] storing an image prefix failed; going on without it")


class VisionEngine(Engine):
    """The batch engine whose requests with images are decoded off the loop's thread first (the module's docstring):
    `submit` checks their images and starts the decode; each turn's `plan_step` admits the requests whose decode
    ended, and keeps the refusals for `step` to answer. While requests only decode, a step waits up to DECODE_POLL_S
    for one to end (the loop reads its inbox and heartbeats between), rather than spin."""

    vision: VisionInput  # the part vision_engine gives the constructor

    def __init__(self, model_path: Path, *, decodes: Decodes, **kwargs: Any) -> None:
        self.decodes = decodes
        self.decode: Callable[..., list] = decode_images  # (images, max_pixels, on_image) -> pictures, on a thread
        self._owed: list[Failed] = []  # refusals found by a plan_step, answered by the next step
        super().__init__(model_path, **kwargs)

    def __len__(self) -> int:
        return super().__len__() + len(self.decodes) + len(self._owed)

    @property
    def rids(self) -> list[str]:
        return [*super().rids, *self.decodes.rids, *(f.rid for f in self._owed)]

    def waiting(self) -> int:
        return super().waiting() + len(self.decodes) + len(self._owed)

    def submit(self, msg: Submit) -> None:
        if msg.rid in self.decodes or any(f.rid == msg.rid for f in self._owed):
            raise RequestRejected(INVALID_REQUEST, f"request id {msg.rid} is already in flight")
        if not msg.images:
            super().submit(msg)
            return
        if msg.rid in super().rids:
            raise RequestRejected(INVALID_REQUEST, f"request id {msg.rid} is already in flight")
        self.vision.check(msg)
        images, max_pixels, decode = msg.images, self.vision.max_batch_pixels, self.decode
        self.decodes.start(msg.rid, lambda on_image: decode(images, max_pixels, on_image), msg)

    def abort(self, rid: str) -> bool:
        if self.decodes.drop(rid):
            return True
        owed = [f for f in self._owed if f.rid != rid]
        if len(owed) < len(self._owed):  # its refusal is owed to a client that is gone
            self._owed = owed
            return True
        return super().abort(rid)

    def fail_all(self, code: str, message: str) -> list[Failed]:
        owed, self._owed = self._owed, []  # answered with their own refusals
        return [*owed, *super().fail_all(code, message)]

    def plan_step(self) -> StepPlan:
        self._admit_decoded()
        if not super().__len__():
            return NOTHING  # only decodes in flight: the step answers refusals or waits for one to end
        return super().plan_step()

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        if self._plan is None:  # a step not planned: the decodes that ended join first, then the step is planned
            self._admit_decoded()
        owed: list[Finished | Failed] = list(self._owed)
        self._owed = []
        if not super().__len__():
            if not owed:
                self.decodes.wait(DECODE_POLL_S)
            return [], owed
        chunks, finished = super().step()
        return chunks, [*owed, *finished]

    def _admit_decoded(self) -> None:
        """Each request whose decode ended is admitted as a submit is (its template, processor and image prefill run
        here), or its refusal is kept for the next step: the decode's (past the deadline, an image that does not
        decode) or the submit's."""
        for msg, outcome in self.decodes.poll():
            if isinstance(outcome, BaseException):
                self._owed.append(self._refusal(msg, outcome))
                continue
            try:
                self._admit(msg, outcome)
            except Exception as exc:
                self._owed.append(self._refusal(msg, exc))

    @staticmethod
    def _refusal(msg: Submit, exc: BaseException) -> Failed:
        if isinstance(exc, RequestRejected):
            return Failed(msg.rid, exc.code, str(exc))
        log.error("[submit] rid=%s failed", msg.rid, exc_info=exc)  # as the loop's _on_submit logs one
        return Failed(msg.rid, INTERNAL_ERROR, f"the worker could not start the request: {exc}")


def load_vision(model_path: Path, report: Callable[[str, float], None]) -> tuple[nn.Module, Any, TokenizerWrapper]:
    """mlx-vlm's model and processor, the weights in memory (reporting the fraction), and mlx-lm's tokenizer."""
    from mlx_vlm import load

    report("reading", 0.0)
    vlm, processor = load(str(model_path), lazy=True)
    leaves = [cast(mx.array, kv[1]) for kv in tree_flatten(vlm.parameters())]
    total, done = sum(v.nbytes for v in leaves) or 1, 0
    for leaf in leaves:
        mx.eval(leaf)
        done += leaf.nbytes
    report("weights", done / total)
    eos = getattr(vlm.config, "eos_token_id", None)
    return vlm, processor, load_tokenizer(model_path, eos_token_ids=eos)


def vision_engine(model_path: Path, report: Callable[[str, float], None] = lambda *_: None,
                  max_images: int = MAX_IMAGES, max_batch_pixels: int = MAX_BATCH_PIXELS,
                  tower_cache_bytes: int = TOWER_CACHE_BYTES, probe: bool = True,
                  decode_deadline_s: float = DECODE_DEADLINE_S, jpeg_max_scans: int = MAX_JPEG_SCANS,
                  **kwargs: Any) -> VisionEngine:
    """The batch engine on a vision-language model (the module's docstring); kwargs are Engine's."""
    loaded: dict[str, Any] = {}

    def loader(path: Path, report: Callable[[str, float], None]) -> tuple:
        vlm, loaded["processor"], tokenizer = load_vision(path, report)
        return VisionDecoder(vlm), tokenizer

    kwargs.setdefault("solo", "plain")  # the compiled decode graph is built for mlx-lm's models

    def vision(decoder: VisionDecoder, prompts: Prompts, caches: PromptCaches | None) -> VisionInput:
        config = decoder.vlm.config
        image_token = getattr(config, "image_token_index", None) or config.image_token_id
        decoder.vlm.vision_tower = CachedTower(decoder.vlm.vision_tower, tower_cache_bytes)
        part = VisionInput(decoder.vlm, decoder, loaded["processor"], int(image_token), prompts, max_images,
                           max_batch_pixels, jpeg_max_scans)
        if probe:
            probe_working_memory(part, model_path.name)
        part.caches = caches  # after the probe: its image is no client's, its prefix not worth keeping
        return part

    return VisionEngine(model_path, decodes=Decodes(decode_deadline_s), report=report, loader=loader, vision=vision,
                        **kwargs)


def probe_working_memory(part: VisionInput, model_id: str) -> int:
    """One image of the processor's largest size through the whole path (decode, processor, tower, prefill), before
    Ready: its peak stays in MLX's buffer cache, so the footprint the worker reports, which admission counts, holds
    an image's working memory, and a later image reuses those buffers. Returns the peak it added (bytes)."""
    from PIL import Image

    ip = part.processor.image_processor
    size = getattr(ip, "size", None)
    side = int(math.isqrt(int(ip.max_pixels))) if getattr(ip, "max_pixels", None) else int(
        max(getattr(size, "height", 0) or 0, getattr(size, "width", 0) or 0) or 896)
    side = min(side, math.isqrt(part.max_batch_pixels))
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    msg = Submit("probe", 1, messages=[{"role": "user", "content": [{"type": "image"}]}],
                 images=[["image/png", buf.getvalue()]])
    tower = cast(CachedTower, part.vlm.vision_tower)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    processed = part.encode(msg)  # decoded on this thread: nothing is served yet
    tokens = processed.ids
    part.prefill(msg.rid, tokens, 0, None, processed)
    tower.kept.clear()  # the probe's features are no image a client sent
    peak = max(0, mx.get_peak_memory() - before)
    log.info("[vision] model=%s probe side=%d tokens=%d working_bytes=%d ms=%d", model_id, side, len(tokens), peak,
             (time.perf_counter() - t0) * 1e3)
    return peak
