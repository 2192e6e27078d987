"""The worker's batch engine: one MLX model and the BatchGenerator that batches its requests.

The only code that touches MLX at generation time. It runs on the worker's main thread
(MLX aborts at exit when generation ran on other threads) and knows nothing of sockets: the
loop in worker/loop.py feeds it Submit/Abort messages and ships what step() returns. It
implements worker/engine_api.py's EngineApi, all the loop knows of it. What is not the batch is
composed in: a Submit made once into an EngineRequest (request.py: its prompt's encoding and checks through
prompt.py, its sampler, logits processors and output through decoding.py, its drafting, its cache keys), which
`_start` then starts in a lane; a vision-language model's images (vision.py's VisionInput, given to the
constructor); the lanes: a request alone (solo.py's SoloLane) and the batch's rows (batch_lane.py's BatchLane, whose
step a few greedy rows drafting together may take, batch_drafting.py), asked the same things of a request
(batch_lane.py's Lane); each step's plan (worker/schedule.py, pure); every row's text (output_stage.py); the
model's loading (loading.py) and the idle warm-up after Ready (warmup.py's WarmUp: `warm_step`).

Invariants: every admitted request ends in exactly one Finished or Failed (a grammar failing
mid-request: a Failed for it alone); a request that is aborted or finished is removed from the
BatchGenerator at once, so it costs no more compute.
With prompt caches (worker/mlx_engine/prompt_cache.py), a request joins the batch with its cached
prefix as its starting cache and only the rest of its prompt to compute; its prompt is inserted
as segments ending at the caches' snapshot points, so that for a model with sliding-window or
recurrent layers the prefill stops there and those layers' state is copied (snapshots.py), as it is at the last
block boundary each reply's decoding crosses (a conversation's next turn diverges after the reply); a finished request
leaves its KV state (and those snapshots) to the caches. A cache failure is logged and costs only
the cache's benefit.
A resumed request (Submit.resume_tokens) joins with its earlier tokens as its prompt's tail; every
chunk carries the ids of the tokens behind its text, which is what a resume continues from.

Steps are bounded by time, not by a token count: before each step, the prefill chunk (the
BatchGenerator's `prefill_step_size`, which it reads on every step) is sized by the scheduler and its step cost
model (worker/schedule.py, worker/step_cost.py) from what this model's steps measured on this machine, so a step
stays near `step_target_s` however long the prompt, and streams already decoding keep flowing
while it is prefilled. The engine follows each request's prefill (tokens left, position) from
the generator's progress reports, so the plan needs nothing of the generator's internals.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from protocol.messages import CONTEXT_WINDOW, INVALID_REQUEST, Failed, Finished, Submit
from protocol.modelconfig import MAX_CONTEXT, context_length, kv_bytes_at, memory_estimate
from worker.chat_format import family_of
from worker.engine_api import RequestRejected
from worker.memory import process_memory_bytes
from worker.mlx_engine.attention import install as attention_route
from worker.mlx_engine.batch_drafting import BUCKETS, BatchDrafting
from worker.mlx_engine.batch_lane import BatchLane, Lane
from worker.mlx_engine.checkpoints import crossed
from worker.mlx_engine.decode_graph import DecodeGraph, solo_modes
from worker.mlx_engine.decoding import Decoding
from worker.mlx_engine.dflash import DFlashHead, load_dflash
from worker.mlx_engine.guided import Grammars
from worker.mlx_engine.loading import load_with_progress, time_one_token
from worker.mlx_engine.mtp import MTPHead, load_head
from worker.mlx_engine.output_stage import OutputStage
from worker.mlx_engine.prompt import Prompts
from worker.mlx_engine.prompt_cache import CacheOptions, PromptCaches
from worker.mlx_engine.quantized_kv import quantize_cache
from worker.mlx_engine.release import release
from worker.mlx_engine.request import EngineRequest, ImagePart, Requests
from worker.mlx_engine.request_state import Request
from worker.mlx_engine.snapshots import Snapshots
from worker.mlx_engine.solo import Solo, SoloLane
from worker.mlx_engine.speculative import DraftCounts, Speculation, load_draft
from worker.mlx_engine.taps import install_tap
from worker.mlx_engine.warmup import Warmed, WarmUp, wants_warm_up
from worker.schedule import Scheduler
from worker.step_cost import PrefillSeq, StepCostModel, StepPlan
from worker.text_thread import TextThread

if TYPE_CHECKING:
    # (the loaded model, its prompts, its caches) -> the engine's vision part (vision.py's VisionInput), made once
    VisionPart = Callable[[Any, Prompts, PromptCaches | None], ImagePart]

# finished sequences whose prompt-cache stores wait, while other requests decode, for an idle engine or the next lookup
# (a store stalls every stream: ~70 ms a step when 8 of 32 ended together on the GPU host); past this, stored at once
DEFERRED_STORES_MAX = 32
# a batch's decode step reuses its plan for this many steps of the same work: its prediction moves slowly, and making
# it solves the step cost model's fits, ~0.09 ms a step at 32 streams on the GPU host (bench.worker_cpu)
DECODE_PLAN_STEPS = 16

log = logging.getLogger(__name__)


def full_precision_context(config: dict, max_context: int, bits: int, group_size: int) -> int:
    """The supervisor's cap counted this model's K/V at `bits` (supervisor/lifecycle.py), its estimate's first
    request's `kv_tokens` too; a worker that keeps full precision (quantized_kv.quantize_cache said why) fits that
    many fewer tokens in the same bytes: (cap + kv_tokens) at `bits` is the room, less kv_tokens at full precision."""
    est = memory_estimate(config)
    if est.kv_bytes_per_token <= 0:
        return max_context
    quantized = kv_bytes_at(est.kv_bytes_per_token, est.kv_dtype_bytes, bits, group_size)
    return max(1, (max_context + est.kv_tokens) * quantized // est.kv_bytes_per_token - est.kv_tokens)


class Engine:
    def __init__(self, model_path: Path, max_batch_size: int = 32, prefill_batch_size: int = 8,
                 prefill_step_size: int = 2048, report: Callable[[str, float], None] = lambda *_: None,
                 cache: CacheOptions | None = None, model_id: str = "", step_target_s: float = 0.25,
                 warm: str = "auto", warm_budget_s: float = 10.0, solo: str = "auto", attention: str = "auto",
                 strict_context: bool = False, max_context: int | None = None, speculative: str = "off",
                 draft: Path | None = None,
                 num_draft_tokens: int | None = None, defer_stores: bool = False, text_thread: bool = False,
                 idle_pricing: bool = False,
                 loader: Callable[[Path, Callable[[str, float], None]], tuple] = load_with_progress,
                 vision: VisionPart | None = None) -> None:
        t0 = time.perf_counter()
        self.attention_routed = attention_route(attention)  # short prefills unfused on CUDA (mlx_engine/attention.py)
        self.model, self.tokenizer = loader(model_path, report)  # a group's rank: its shard (mlx_engine/group.py)
        # the running K/V quantized at the caches' kv_bits, before anything makes a cache (quantized_kv.py);
        # its group size, None: full precision
        self.kv_group = quantize_cache(self.model, cache.kv_bits, cache.kv_group_size) if cache is not None else None
        config = json.loads((model_path / "config.json").read_text())
        text_config = {**config, **(config.get("text_config") or {})}  # Qwen3.5 and other multimodal layouts
        # the config's max_position_embeddings, never past MAX_CONTEXT nor the supervisor's cap (--max-context: what
        # its memory ceiling leaves for this model's KV, protocol/modelconfig.py): what Ready publishes and prompts meet
        if max_context and cache is not None and cache.kv_bits and self.kv_group is None:
            max_context = full_precision_context(config, max_context, cache.kv_bits, cache.kv_group_size)
        self.context_length = min(context_length(config), max_context or MAX_CONTEXT)
        self.vocab_size = int(text_config.get("vocab_size") or 0)
        self.weights_bytes = sum(p.stat().st_size for p in model_path.glob("*.safetensors"))
        eos = sorted(self.tokenizer.eos_token_ids)
        self.family = family_of(self.tokenizer)
        # strict_context: max_tokens past the context is refused, not clamped (prompt.py)
        self.prompts = Prompts(self.tokenizer, self.vocab_size, self.context_length, strict_context)
        self.grammars = Grammars(self.tokenizer._tokenizer, eos, self.vocab_size)
        self.decoding = Decoding(self.tokenizer, self.family, self.vocab_size, self.grammars)
        self._sampler, self._samplers = self.decoding.sampler, self.decoding.samplers  # tests read them by these names
        self._eos = set(eos)
        self._stop_eos = StopSequences([[t] for t in eos])
        self._stop_none = StopSequences(None)
        self.gen = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,  # a cap: plan_step() sets each step's chunk below it
        )
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.cost = StepCostModel(step_target_s, prefill_step_size, time_one_token(self.model))
        self.schedule = Scheduler(self.cost, max_batch_size, prefill_batch_size, DECODE_PLAN_STEPS)  # schedule.py
        # a request alone runs the generate_step way (solo.py): compiled, or each step's graph built ahead
        self.solo_on, compiled, ahead = solo_modes(solo)
        # a drafter on the target's hidden states, its layers tapped before any graph is made (taps.py): a DFlash drafter
        # (dflash.py, --draft), or the checkpoint's MTP head (mtp.py) where it drafts
        head: MTPHead | DFlashHead | None = None
        if speculative == "dflash" and draft is not None:
            head = load_dflash(draft, self.model)
            install_tap(self.model, head.layers)
            self.weights_bytes += sum(p.stat().st_size for p in draft.glob("*.safetensors"))
        elif (speculative == "mtp" or speculative == "auto" and mx.default_device() == mx.gpu) and draft is None and (
                head := load_head(self.model, model_path)):  # (auto drafts nothing on a CPU: the head is not read)
            install_tap(self.model)
        self.graph = DecodeGraph(self.model) if compiled else None  # a solo's decode steps compiled
        draft_model, draft_bytes = load_draft(draft, self.tokenizer) if draft is not None and (
            speculative != "dflash") else (None, 0)
        self.weights_bytes += draft_bytes  # admission counts the draft model's weights as the model's
        # idle_pricing: what drafting costs here is measured in the idle work (`warm_step`), not on a request's step
        speculation = Speculation(speculative, num_draft_tokens, draft_model, self.vocab_size, idle=idle_pricing,
                                  head=head)
        # the decode graph's first trace and the batch shapes are warmed after Ready, a step at a time while idle
        self.warmer = WarmUp(self.model, self.graph, max_batch_size, prefill_batch_size, prefill_step_size,
                             warm_budget_s, model_id) if wants_warm_up(warm) else None
        self.warmed: Warmed | None = self.warmer.warmed if self.warmer is not None else None
        self.model_id = model_id
        self._prefilling: dict[str, Request] = {}  # requests with prompt left to prefill, in arrival order
        self._plan: StepPlan | None = None
        self._in_flight = 0  # sequences of the last step's decode: launched, and what the next step waits for
        self._by_uid: dict[int, Request] = {}
        self._by_rid: dict[str, Request] = {}
        self.generated_tokens = 0
        self.peak_batch_size = 0
        self.caches = PromptCaches(self.model, model_path, cache, model_id) if cache else None
        # the worker's loop sends a step's messages first, then has `after_send` store its finished sequences' caches
        # (~1 ms each here: 32 streams ending together waited for all 32 before their last message), or, while other
        # requests decode, leave them for an idle engine or the next lookup (`_flush_stores`); direct callers of step()
        # get them stored within it
        self.defer_stores = defer_stores
        self._stores: list[tuple[list[int] | None, list | None, dict, int]] = []  # ..., the caches' clears then
        # the worker's batch rows' text is made on a thread of its own, during the next step's launch (text_thread.py)
        self.output = OutputStage(TextThread() if text_thread else None)  # every row's text (output_stage.py)
        # greedy batches of a few rows draft in lockstep (batch_drafting.py), and the solo drafts, meeting each
        # reply-snapshot boundary
        boundary = self.caches.block if self.caches is not None and self.caches.layout.snapshots else 0
        self.lane = SoloLane(self.model, self.gen, self._stop_eos, self._stop_none, self.graph, boundary, ahead)
        self.snapshots = Snapshots(self.caches, self.gen, self.lane, self._by_uid) if self.caches is not None else None
        self.batch_drafts = BatchDrafting(self.model, self.gen, boundary)
        self.batch = BatchLane(self.gen, self.batch_drafts, self._stop_none)  # batch_lane.py
        self.released: list[str] = []  # settle's release steps, in their order (release.py)
        self.load_s = time.perf_counter() - t0
        # a vision-language model's images (vision.py's VisionInput: their prompts, cache keys and prefill), made from
        # the loaded model once the caches are (its probe of an image's working memory is not the load's time)
        self.vision = vision(self.model, self.prompts, self.caches) if vision is not None else None
        self.requests = Requests(self.prompts, self.decoding, speculation, self.caches, self.vision)  # request.py

    # --- admission ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_rid)

    @property
    def rids(self) -> list[str]:
        return list(self._by_rid)

    def batch_size(self) -> int:
        solo = self.lane.solo
        return len(self.gen._generation_batch) + (solo is not None and solo.decoding)

    def waiting(self) -> int:
        return len(self._by_rid) - self.batch_size()

    @property
    def _solo(self) -> Solo | None:  # the request alone, if any (tests read it by this name)
        return self.lane.solo

    @property
    def drafting(self) -> str:
        return self.speculation.mode

    @property
    def priced(self) -> bool:
        return self.speculation.mode != "off" and self.speculation.pricing.costs is not None

    @property
    def speculation(self) -> Speculation:  # the requests' drafting, as configured (tests swap it)
        return self.requests.speculation

    @speculation.setter
    def speculation(self, speculation: Speculation) -> None:
        self.requests.speculation = speculation

    def tokenize(self, msg: Submit) -> list[int]:
        """The prompt's token ids as `submit` would encode and check them; nothing generated, the batch untouched."""
        return self.requests.tokenize(msg)

    def submit(self, msg: Submit) -> None:
        """Admit a request: made once into an EngineRequest (request.py: its tokens, max_tokens capped to the context's
        room, decoding, drafting, cache keys), then started (`_start`)."""
        self._admit(msg)

    def _admit(self, msg: Submit, pictures: list | None = None) -> None:
        if msg.rid in self._by_rid:
            raise RequestRejected(INVALID_REQUEST, f"request id {msg.rid} is already in flight")
        self._start(self.requests.build(msg, pictures))

    def _start(self, r: EngineRequest) -> None:
        """Start a request: its prefix from the prompt caches (or the vision part's image prefill), its marks kept, and
        its lane: the solo if it is alone and needs nothing only the batch has (`alone_ok`), else the batch (stopped
        at max_tokens by the context's room, it finishes as "context_window")."""
        tokens, keys = r.tokens, r.keys
        if self._stores:  # a conversation's next turn finds its last one's cache
            self._flush_stores()
        cached, prefix, hit = self._lookup(r)
        marked = 0  # the end of the last breakpoint's prefix: Anthropic's usage counts a cache write up to there only
        if self.caches is not None:
            for end, ttl_s in r.marks:  # cache_control breakpoints, a prompt_cache_key: prefixes kept a while
                self.caches.keep(keys[:end], ttl_s)
                marked = max(marked, end)
        # a hybrid's prefill also stops where the prompt leaves a cached one (caches.matched) and where sibling
        # sessions branch off (its head of system prompt and tools, its first user turn's parts): they pick up there
        points = [] if self.caches is None else self.caches.snapshot_points(
            len(tokens), cached, self.caches.matched, list(r.branches))
        # its lane: each takes the request, its cached tokens, their cache and its snapshot points, and gives its uid
        if self.solo_on and not self._by_rid and r.alone_ok:
            uid = self.lane.start(r, cached, prefix, points, self._eos)
        else:
            self._solo_to_batch()
            uid = self.batch.start(r, cached, prefix, points, self._stop_eos)
        d, drafting = r.decoding, r.drafting
        req = Request(r.rid, uid, r.prompt_tokens, d.out, completion_tokens=r.resumed,
                      cached_tokens=min(hit, r.prompt_tokens), prefill_left=len(tokens) - cached - 1, position=cached,
                      start=cached, snapshot_at=frozenset(points), grammar=d.grammar, clamped=r.clamped,
                      drafts=drafting.counts if drafting is not None else DraftCounts(),
                      cache_written=max(0, min(self.caches.kept_end(r.prompt_tokens), marked) - hit)
                      if self.caches is not None else 0,
                      keys=keys if keys is not tokens else None, checkpointed=cached)
        self._by_uid[uid] = req
        self._by_rid[r.rid] = req
        if req.prefill_left > 0:
            self._prefilling[r.rid] = req

    def _lane_of(self, uid: int) -> Lane:
        """The lane running a request: the solo lane for the solo, else the batch's."""
        solo = self.lane.solo
        return self.lane if solo is not None and solo.uid == uid else self.batch

    def _lookup(self, r: EngineRequest) -> tuple[int, list | None, int]:
        """(tokens in the request's starting cache, that cache, how many of them the prompt caches gave: its
        usage's cached tokens; a prefix computed here for an image was prefilled, not cached)."""
        cached, prefix = 0, None
        if self.caches is not None:
            try:
                cached, prefix = self.caches.lookup(r.keys)
            except Exception:
                log.exception("[cache] rid=%s lookup failed; computing the whole prompt", r.rid)
        if self.vision is not None and (computed := self.vision.prefill(r.rid, r.tokens, cached, prefix,
                                                                        r.images)) is not None:
            return computed  # a prefix computed outside the batch (an image's, mlx_engine/vision.py)
        return cached, prefix, cached

    def _store(self, tokens: list[int] | None, cache: list | None, snapshots: dict, tail: bool = True) -> None:
        if self.caches is None or not tokens or not cache:
            return
        try:
            self.caches.store(list(tokens), cache, snapshots, tail)
        except Exception:
            log.exception("[cache] storing a finished sequence failed; going on")

    def _hand_off(self) -> None:
        """The blocks stored at earlier steps, evaluated meanwhile, go to the SSD writer without a wait."""
        if self.caches is None:
            return
        try:
            self.caches.hand_off()
        except Exception:
            log.exception("[cache] handing blocks to the SSD writer failed; going on")

    def abort(self, rid: str) -> bool:
        """Forget a request; what it computed goes to the prompt caches, as a finished one's does (a client that
        left mid-prefill and retries picks up where it was)."""
        req = self._by_rid.pop(rid, None)
        if req is None:
            return False
        del self._by_uid[req.uid]
        self._prefilling.pop(rid, None)
        lane = self._lane_of(req.uid)
        computed: tuple[list | None, list[int] | None] = (None, None)
        try:  # what it computed, best effort (a generator that raised mid-step may not give it)
            if self.caches is not None and self.caches.enabled and req.position > req.checkpointed and (
                    lane is self.lane or req.uid >= 0):  # not a solo's last token, pending after its hand-over
                computed = lane.computed(req.uid)
        except Exception:
            log.exception("[cache] rid=%s keeping an aborted request's cache failed; going on", req.rid)
        if not self.lane.drop(req.uid) and req.uid >= 0:
            self.batch.drop(req.uid)
        if computed[0] is not None:
            self._keep(req, *computed)
        log.info("[usage] rid=%s prompt=%d cached=%d prefilled=%d aborted", req.rid, req.prompt_tokens,
                 req.cached_tokens, req.position - req.start)  # what a retry can pick up: the caches hold it
        return True

    def _keep(self, req: Request, cache: list | None, tokens: list[int] | None, tail: bool = True) -> None:
        """A request's computed cache to the prompt caches: at its end, its abort, a prefill checkpoint."""
        if req.keys is not None and tokens is not None:  # the caches know an image by its pixels, not its ids
            tokens = [*req.keys, *list(tokens)[len(req.keys):]]
        if self.defer_stores and self.caches is not None and tail:
            self._stores.append((tokens, cache, req.snapshots, self.caches.clears))
        else:
            self._store(tokens, cache, req.snapshots, tail)

    def _checkpoint(self, progress: list) -> None:
        """The prompts whose prefill crossed a block boundary in this step leave their new blocks to the caches now
        (checkpoints.py): a retry, or a resume on a new worker, picks up from there."""
        assert self.caches is not None
        block, solo = self.caches.block, self.lane.solo
        if solo is not None:
            reqs = [self._by_uid[solo.uid]] if solo.uid in self._by_uid else []
        else:
            reqs = [req for p in progress if (req := self._by_uid.get(p.uid)) is not None]
        for req in reqs:
            if not crossed(req.checkpointed, req.position, block):
                continue
            req.checkpointed = req.position
            try:
                computed = self._lane_of(req.uid).row(req.uid, self.caches.layout.block_layers)
                if computed is not None:
                    self._keep(req, *computed, tail=False)
            except Exception:
                log.exception("[cache] rid=%s prefill checkpoint failed; going on", req.rid)

    def _solo_to_batch(self) -> None:
        """A second request came: the solo, if any, goes into the batch under the generator's uid for it."""
        solo = self.lane.solo
        moved = self.lane.to_batch()
        if moved is not None and solo is not None:
            solo_uid, uid, start = moved
            req = self._by_uid.pop(solo_uid)
            req.uid, req.start = uid, start
            self._by_uid[uid] = req
            self.batch_drafts.add(uid, solo.drafting)

    def _solo_step(self) -> tuple[list, list]:
        """The solo's step: a prefill chunk, or one token (generate_step's pipelining)."""
        solo = self.lane.solo
        assert solo is not None
        req = self._by_uid[solo.uid]
        responses = solo.step(self.gen.prefill_step_size)
        req.position, req.prefill_left = min(solo.fed, solo.prompt_len), solo.prefill_left
        if self.snapshots is not None and not solo.decoding:  # its prefill stops at each snapshot point
            self.snapshots.at_solo_stop(req, solo)
        if not solo.prefill_left:
            self._prefilling.pop(req.rid, None)
        return [], responses

    # --- generation --------------------------------------------------------------------

    def plan_step(self) -> StepPlan:
        """Size the next step's prefill chunk to the step target (schedule.py, from what the engine holds: its
        decoding sequences, its prompts still prefilling, oldest first, the decode in flight); the plan says what it
        holds and its predicted time."""
        if (solo := self.lane.solo) is not None and solo.decoding:
            self._plan = self.schedule.solo(solo.uid)
            return self._plan
        work = self.schedule.work(len(self._by_rid) - len(self._prefilling),
                                  (PrefillSeq(req.prefill_left, req.position) for req in self._prefilling.values()),
                                  self._in_flight)
        plan = self._plan = self.schedule.plan(work)
        self.gen.prefill_step_size = max(plan.chunk, self.cost.min_chunk)
        return plan

    def _on_prefill_progress(self, uid: int, done: int, total: int) -> None:
        req = self._by_uid.get(uid)
        if req is None:
            return
        req.prefill_left = max(0, total - 1 - done)
        req.position = req.start + done
        if req.prefill_left == 0:
            self._prefilling.pop(req.rid, None)

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        """One BatchGenerator step: text chunks [[rid, text, n]] and the requests that ended (Failed: its grammar
        failed mid-request). With a text thread, a batch row's text comes a step later (text_thread.py)."""
        plan = self._plan or self.plan_step()
        self._plan = None
        self.output.launch()  # the last step's rows' text is made while this step's kernels launch
        t0 = time.perf_counter()
        lane = self.lane
        if lane.solo is not None:
            (progress, responses), drafted = self._solo_step(), False
        else:  # the batch's step, or its rows' drafting step in its place
            progress, responses, drafted = self.batch.step()
        elapsed = time.perf_counter() - t0
        if plan is not self.schedule.solo_plan and not drafted:  # a solo's decode step, or a drafting step, is no
            self.cost.observe(plan, elapsed)  # plain batch step the fits could learn from
        if log.isEnabledFor(logging.DEBUG) and (plan.prefill_tokens or plan.decoding != self._in_flight):
            # a ramp's step (a prefill, or the decode batch's size changed): its shape, time and when it ended
            log.debug("[step] at_ms=%.1f chunk=%d prefill=%d rows=%d decoding=%d predicted_ms=%.1f ms=%.1f",
                      time.perf_counter() * 1e3, plan.chunk, plan.prefill_tokens, len(self.gen._prompt_batch),
                      plan.decoding, plan.predicted_s * 1e3, elapsed * 1e3)
        if lane.pending:
            responses, lane.pending = [*lane.pending, *responses], []
        self._in_flight = plan.decoding  # their decode is computing; the next step waits for it
        self._hand_off()
        for p in progress:
            self._on_prefill_progress(p.uid, *p.progress)
        if self.snapshots is not None:
            self.snapshots.at_prefill_stops(progress)
            self.snapshots.of_replies()
        if self.caches is not None and self.caches.enabled and (progress or (lane.solo and not lane.solo.decoding)):
            self._checkpoint(progress)  # prefill steps only: a decode step (the hot path) never enters it
        self.peak_batch_size = max(self.peak_batch_size, len({r.uid for r in responses}))  # a solo's drafts: one
        lag = self.output.text is not None and lane.solo is None  # a batch row's text may come a step later
        chunks, finished = self.output.rows(responses, self._by_uid, self._eos, lag, self._end, self._grammar_failures)
        self.generated_tokens += self.output.counted
        if not self._by_rid and not self._stores:
            self._hand_off()  # idle next: no step would hand them off, and none is in flight to wait for
        return chunks, finished

    def _end(self, req: Request, r: Any, reason: str, finished: list[Finished | Failed]) -> None:
        """A request ends: its Finished, and its cache to the prompt caches. `r`: its response that ended it, if the
        generator (or the solo) ended it; None: the generator still runs it."""
        text, extra, reason = req.out.finish(reason)
        if reason == "length" and req.clamped:
            reason = CONTEXT_WINDOW
        finished.append(Finished(req.rid, text, reason, req.prompt_tokens, req.completion_tokens,
                                 req.cached_tokens, req.unsent, extra, req.drafts.drafted, req.drafts.accepted,
                                 req.cache_written))
        log.info("[usage] rid=%s prompt=%d cached=%d prefilled=%d", req.rid, req.prompt_tokens, req.cached_tokens,
                 req.position - req.start)  # the generator's own progress, not the lookup's arithmetic
        del self._by_uid[req.uid]
        del self._by_rid[req.rid]
        self._prefilling.pop(req.rid, None)
        lane = self._lane_of(req.uid)
        if (solo := self.lane.solo) is not None and lane is self.lane:
            assert r is not None
            log.info("[perf] solo rid=%s tokens=%d per_token_ms=%s", req.rid, solo.times.tokens,
                     solo.times.per_token_ms())
        cache, tokens = lane.finish(req.uid, r)  # a batch row's stop string: the generator still runs it
        self._keep(req, cache, tokens)

    def after_send(self) -> None:
        """The finished sequences' prompt-cache stores that the steps left for after their messages were sent, once the
        engine is idle (or DEFERRED_STORES_MAX wait): none stalls the streams still decoding. A lookup stores them
        first (`submit`), so a later request finds them as if they had been stored at once."""
        if self._stores and (not self._by_rid or len(self._stores) >= DEFERRED_STORES_MAX):
            self._flush_stores()

    def _flush_stores(self) -> None:
        """Store every deferred finished sequence's cache (one from before a clear of the caches is dropped), then,
        idle, hand their blocks off."""
        stores, self._stores = self._stores, []
        for tokens, cache, snapshots, clears in stores:
            if self.caches is not None and clears == self.caches.clears:
                self._store(tokens, cache, snapshots)
        if not self._by_rid:
            self._hand_off()

    def _grammar_failures(self) -> list[Failed | Finished]:
        """End the requests whose grammar failed in this step: what they sample now is no longer constrained."""
        failed: list[Failed | Finished] = []
        for req in [r for r in self._by_rid.values() if r.grammar is not None and r.grammar.failure is not None]:
            assert req.grammar is not None and req.grammar.failure is not None
            log.warning("[grammar] rid=%s failed mid-request grammar_chars=%d tokens=%d error=%r", req.rid,
                        req.grammar.grammar_chars, req.completion_tokens, req.grammar.failure)
            failed.append(Failed(req.rid, INVALID_REQUEST, f"constrained decoding failed after "
                                                           f"{req.completion_tokens} tokens: {req.grammar.failure}"))
            self.abort(req.rid)
        return failed

    def fail_all(self, code: str, message: str) -> list[Failed]:
        failed = [Failed(rid, code, message) for rid in self.rids]
        for f in failed:
            self.abort(f.rid)
        return failed

    def warm_step(self) -> bool:
        """One step of the idle work, if nothing is in flight: the warm-up (warmup.py), then what drafting costs here
        (draft_pricing.py: the solo's, then a batch's at each size it drafts at); False once it is all over."""
        if len(self):
            return True  # busy: later, when idle
        if self.warmer is not None:
            if self.warmer.step():
                return True
            self.warmer = None
        return self.speculation.price_step(self.model, self.graph, tuple(b for b in BUCKETS if b <= self.max_batch_size))

    def close_caches(self) -> None:
        if self._stores:
            self._flush_stores()
        if self.caches is not None:
            self.caches.close()

    def settle(self) -> int:
        """Stop the engine's threads, then give back everything MLX holds (release.py: the device synchronized, the
        model, generator and caches dropped, MLX's buffer cache cleared); return the process footprint left. The
        engine serves nothing after it."""
        self.lane.close()
        self.output.close()
        if self.warmer is not None:
            self.warmer.close()
            self.warmer = None
        self.gen.close()
        self.released = release(self._drop)
        return process_memory_bytes()

    def _drop(self) -> None:
        """Every reference this engine holds to MLX arrays: the model, its generator, lanes, caches, drafts."""
        self._stores = []
        self.output.clear()
        self._by_uid, self._by_rid, self._prefilling = {}, {}, {}
        for name in ("model", "gen", "lane", "batch", "graph", "requests", "caches", "snapshots", "batch_drafts", "vision",
                     "prompts", "_plan"):
            vars(self)[name] = None
