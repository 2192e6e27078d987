"""The worker's engine: one MLX model and the BatchGenerator that batches its requests.

The only code that touches MLX at generation time. It runs on the worker's main thread
(MLX aborts at exit when generation ran on other threads) and knows nothing of sockets: the
loop in worker/loop.py feeds it Submit/Abort messages and ships what step() returns. It
implements worker/engine_api.py's EngineApi, all the loop knows of it.

Invariants: every admitted request ends in exactly one Finished or Failed; a request that is
aborted or finished is removed from the BatchGenerator at once, so it costs no more compute.
With prompt caches (worker/mlx_engine/prompt_cache.py), a request joins the batch with its cached
prefix as its starting cache and only the rest of its prompt to compute; its prompt is inserted
as segments ending at the caches' snapshot points, so that for a model with sliding-window or
recurrent layers the prefill stops there and those layers' state is copied; a finished request
leaves its KV state (and those snapshots) to the caches. A cache failure is logged and costs only
the cache's benefit.
A resumed request (Submit.resume_tokens) joins with its earlier tokens as its prompt's tail and
its text stream replayed through them, so its text continues exactly where its client's stopped;
every chunk carries the ids of the tokens behind its text, which is what a resume continues from.
A request with a reasoning budget gets one more logits processor (worker/mlx_engine/budget.py) that closes its
reasoning once the budget is spent; `tokenize` encodes a prompt as `submit` would, and touches nothing else.

After Ready, while nothing is in flight, the batch shapes a ramp of arrivals meets can be run once on
dummy tokens (`warm_step`, worker/mlx_engine/warmup.py; `warm`: auto = on a GPU only), so a ramp does
not wait for kernels.

Steps are bounded by time, not by a token count: before each step, the prefill chunk (the
BatchGenerator's `prefill_step_size`, which it reads on every step) is sized by the step cost
model (worker/step_cost.py) from what this model's steps measured on this machine, so a step
stays near `step_target_s` however long the prompt, and streams already decoding keep flowing
while it is prefilled. The engine follows each request's prefill (tokens left, position) from
the generator's progress reports, so the plan needs nothing of the generator's internals.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from protocol.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    CONTEXT_WINDOW,
    INVALID_REQUEST,
    Failed,
    Finished,
    Submit,
)
from worker.chat_format import ConstraintError, family_of, grammar_for, parser_for, starts_in_think
from worker.engine_api import RequestRejected
from worker.memory import process_memory_bytes
from worker.mlx_engine import scripted
from worker.mlx_engine.attention import install as attention_route
from worker.mlx_engine.budget import budget_of, reasoning_budget
from worker.mlx_engine.decode_graph import DecodeGraph, solo_modes
from worker.mlx_engine.guided import GrammarProcessor, Grammars, logprob_entries, penalty_processors, seeded_sampler
from worker.mlx_engine.prompt_cache import CacheOptions, PromptCaches
from worker.mlx_engine.solo import Solo, SoloResponse
from worker.mlx_engine.warmup import ShapeWarmer, Warmed, wants_warm_up
from worker.request_output import RequestOutput
from worker.step_cost import PrefillSeq, StepCostModel, StepPlan, StepWork
from worker.template_input import (
    chat_template_args,
    special_token_ids,
    special_token_texts,
    template_messages,
    template_tools,
    tool_names,
)
from worker.textstream import TextStream

log = logging.getLogger(__name__)

SAMPLERS_KEPT = 16  # samplers kept for reuse, by (temperature, top_p, top_k, min_p), least recently used dropped


@dataclass(slots=True)
class Request:
    rid: str
    uid: int
    prompt_tokens: int
    out: RequestOutput
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_left: int = 0  # prompt tokens still to prefill (the last one is decoded, not prefilled)
    position: int = 0  # prompt tokens in its cache so far
    start: int = 0  # prompt tokens in its cache when it joined the generator (its progress counts from there)
    snapshot_at: frozenset[int] = frozenset()  # prompt positions where its prefill stops for a cache snapshot
    snapshots: dict = field(default_factory=dict)  # block index -> the snapshot taken at that block's end
    unsent: list[int] = field(default_factory=list)  # generated ids whose text has not gone out yet
    grammar: GrammarProcessor | None = None
    clamped: bool = False  # its max_tokens reaches the context's end: stopping there is the context's doing


def load_with_progress(model_path: Path, report: Callable[[str, float], None]) -> tuple:
    """mlx_lm.load, lazily, then the weights brought into memory in slices, reporting the fraction done."""
    report("reading", 0.0)
    model, tokenizer = cast(tuple[nn.Module, TokenizerWrapper], load(str(model_path), lazy=True))
    leaves = [cast(mx.array, kv[1]) for kv in tree_flatten(model.parameters())]
    total = sum(v.nbytes for v in leaves) or 1
    done, reported = 0, 0.0
    for leaf in leaves:
        mx.eval(leaf)
        done += leaf.nbytes
        if done / total - reported >= 0.05:
            reported = done / total
            report("weights", reported)
    mx.eval(model(mx.array([[0]])))  # compiles the first kernels now, not in the first request
    return model, tokenizer


def time_one_token(model: nn.Module) -> float:
    """Seconds of one token's forward pass: the step cost model's seed, more than a prefilled token costs."""
    t0 = time.perf_counter()
    mx.eval(model(mx.array([[0]])))
    return time.perf_counter() - t0


class Engine:
    def __init__(self, model_path: Path, max_batch_size: int = 32, prefill_batch_size: int = 8,
                 prefill_step_size: int = 2048, report: Callable[[str, float], None] = lambda *_: None,
                 cache: CacheOptions | None = None, model_id: str = "", step_target_s: float = 0.25,
                 warm: str = "auto", warm_budget_s: float = 10.0, solo: str = "auto", attention: str = "auto",
                 strict_context: bool = False,
                 loader: Callable[[Path, Callable[[str, float], None]], tuple] = load_with_progress) -> None:
        t0 = time.perf_counter()
        self.attention_routed = attention_route(attention)  # short prefills unfused on CUDA (mlx_engine/attention.py)
        self.model, self.tokenizer = loader(model_path, report)  # a group's rank: its shard (mlx_engine/group.py)
        config = json.loads((model_path / "config.json").read_text())
        text_config = {**config, **(config.get("text_config") or {})}  # Qwen3.5 and other multimodal layouts
        self.context_length = int(text_config.get("max_position_embeddings") or 4096)
        self.strict_context = strict_context  # max_tokens past the context is refused, not clamped (submit)
        self.vocab_size = int(text_config.get("vocab_size") or 0)
        self.weights_bytes = sum(p.stat().st_size for p in model_path.glob("*.safetensors"))
        eos = sorted(self.tokenizer.eos_token_ids)
        self.family = family_of(self.tokenizer)
        self._special = special_token_ids(self.tokenizer) - self.family.visible_specials
        self._special_texts = special_token_texts(self.tokenizer)
        self.grammars = Grammars(self.tokenizer._tokenizer, eos, self.vocab_size)
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
        self.solo_on, compiled = solo_modes(solo)  # a request alone runs the generate_step way (mlx_engine/solo.py)
        self.graph = DecodeGraph(self.model) if compiled else None  # a solo's decode steps compiled
        # the decode graph's first trace and the batch shapes are warmed after Ready, a step at a time while idle
        self._trace_graph = self.graph is not None and wants_warm_up(warm)
        self.warmer = ShapeWarmer(self.model, max_batch_size, prefill_batch_size, prefill_step_size,
                                  warm_budget_s) if wants_warm_up(warm) else None
        self.warmed: Warmed | None = self.warmer.warmed if self.warmer is not None else None
        self.model_id = model_id
        self._solo: Solo | None = None
        self._solo_plan: StepPlan | None = None  # the plan of every solo decode step (plan_step)
        self._solo_uids = 0
        self._pending: list[SoloResponse] = []  # a solo's token read when it joined the batch, emitted next step
        self._prefilling: dict[str, Request] = {}  # requests with prompt left to prefill, in arrival order
        self._plan: StepPlan | None = None
        self._in_flight = 0  # sequences of the last step's decode: launched, and what the next step waits for
        self._samplers: OrderedDict[tuple, Callable] = OrderedDict()
        self._by_uid: dict[int, Request] = {}
        self._by_rid: dict[str, Request] = {}
        self.generated_tokens = 0
        self.peak_batch_size = 0
        self.caches = PromptCaches(self.model, model_path, cache, model_id) if cache else None
        self.load_s = time.perf_counter() - t0

    # --- admission ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_rid)

    @property
    def rids(self) -> list[str]:
        return list(self._by_rid)

    def batch_size(self) -> int:
        return len(self.gen._generation_batch) + (self._solo is not None and self._solo.decoding)

    def waiting(self) -> int:
        return len(self._by_rid) - self.batch_size()

    def encode_prompt(self, msg: Submit) -> list[int]:
        if msg.messages is not None:
            try:
                return list(self.tokenizer.apply_chat_template(
                    template_messages(msg.messages), tools=template_tools(msg.tools),
                    **chat_template_args(msg.messages, msg.template_kwargs)))
            except Exception as exc:  # a template can reject roles or shapes it does not know
                raise RequestRejected(INVALID_REQUEST, f"chat template rejected the messages: {exc}") from None
        if msg.prompt_ids is not None:
            if any(not 0 <= t < self.vocab_size for t in msg.prompt_ids if self.vocab_size):
                raise RequestRejected(INVALID_REQUEST, f"a prompt token id is outside the vocabulary "
                                                       f"(0-{self.vocab_size - 1})")
            return list(msg.prompt_ids)
        prompt = msg.prompt or ""
        bos = self.tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special))

    def tokenize(self, msg: Submit) -> list[int]:
        """The prompt's token ids as `submit` would encode and check them; nothing generated, the batch untouched."""
        self._check_ids(msg)
        return self.encode_prompt(msg)

    def _top_k(self, msg: Submit) -> int:
        return msg.top_k if self.vocab_size <= 0 or msg.top_k < self.vocab_size else 0

    def _sampler(self, msg: Submit) -> Callable | None:
        if msg.temperature == 0:
            return None  # the generator's greedy fallback; shared, so the batch samples in one call
        # top_k at or past the vocabulary keeps every token, as OpenAI-compatible servers read it; mlx-lm
        # raises on it inside the batched step instead, failing the whole batch (and the generator after it)
        top_k = self._top_k(msg)
        key = (msg.temperature, msg.top_p, top_k, msg.min_p)
        sampler = self._samplers.pop(key, None)
        if sampler is None:
            top_p = msg.top_p if msg.top_p < 1.0 else 0.0
            sampler = make_sampler(msg.temperature, top_p=top_p, min_p=msg.min_p, top_k=top_k)
        self._samplers[key] = sampler  # the most recently used last
        while len(self._samplers) > SAMPLERS_KEPT:
            self._samplers.popitem(last=False)
        return sampler

    def _check_ids(self, msg: Submit) -> None:
        """Refuse what would index past the vocabulary (mlx's scatter does not check: it would write out of
        bounds) or put special-token text into the prompt through a tool's name."""
        vocab = self.vocab_size or len(self.tokenizer.get_vocab())
        for pair in msg.logit_bias or []:
            t = pair[0] if isinstance(pair, list | tuple) and len(pair) == 2 else None
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestRejected(INVALID_REQUEST, f"logit_bias holds a token id outside the vocabulary "
                                                       f"(0-{vocab - 1})")
        for name in tool_names(msg.tools, msg.messages):
            if any(text in name for text in self._special_texts):
                raise RequestRejected(INVALID_REQUEST, f"the tool name {name[:80]!r} holds a special token's text")

    def _decoding(self, msg: Submit, tokens: list[int]) -> tuple[Callable | None, list, RequestOutput,
                                                                GrammarProcessor | None]:
        """A request's sampler, logits processors, output (parser, logprobs) and grammar, from its options; `tokens`
        is its prompt (without a resumed request's earlier tokens, which its output and grammar are replayed through)."""
        chat = msg.messages is not None
        in_think = chat and starts_in_think(self.family, self.tokenizer.decode(tokens[-4:]))
        processors = penalty_processors(msg.presence_penalty, msg.frequency_penalty, msg.repetition_penalty,
                                        msg.logit_bias)
        grammar = None
        if msg.constraint is not None:
            try:  # a resumed request's grammar is past what it generated
                grammar = self.grammars.processor(grammar_for(self.family, msg.constraint, msg.tools, in_think),
                                                  msg.resume_tokens)
                processors.append(grammar)
            except ConstraintError as exc:
                what = msg.constraint.get("name") or ("the tool call" if msg.constraint.get("type") == "tool"
                                                      else "the response format")
                raise RequestRejected(INVALID_REQUEST, f"cannot constrain decoding to {what}: {exc}") from None
        if chat and (budget := reasoning_budget(self.family, self.tokenizer, budget_of(
                msg.reasoning_budget, msg.template_kwargs), in_think, msg.resume_tokens)) is not None:
            processors.append(budget)
        processors += scripted.processors(msg.messages, self.tokenizer, len(msg.resume_tokens))  # tests only
        sampler = self._sampler(msg) if msg.seed is None else seeded_sampler(
            msg.temperature, msg.top_p, msg.min_p, self._top_k(msg), msg.seed, skip=len(msg.resume_tokens))
        logprobs = logprob_entries(self.tokenizer.decode, msg.logprobs) if msg.logprobs >= 0 else None
        parser = parser_for(self.family, chat, bool(msg.tools), in_think)
        out = RequestOutput(TextStream(self.tokenizer.detokenizer, msg.stop, self._special), parser, logprobs)
        out.replay(msg.resume_tokens)  # a resumed request's output continues exactly where its client's stopped
        return sampler, processors, out, grammar

    def submit(self, msg: Submit) -> None:
        if msg.rid in self._by_rid:
            raise RequestRejected(INVALID_REQUEST, f"request id {msg.rid} is already in flight")
        self._check_ids(msg)
        tokens = self.encode_prompt(msg)
        if not tokens:
            raise RequestRejected(INVALID_REQUEST, "the prompt is empty")
        prompt_tokens = len(tokens)
        tokens += self._resume_tokens(msg)
        # max_tokens is a ceiling: what the context leaves after the prompt (and a resumed request's earlier
        # tokens) caps it, and a request stopped there finishes as "context_window"; refused only when the prompt
        # leaves no room, or, with strict_context, when max_tokens does not fit (0: up to the context)
        room = self.context_length - len(tokens)
        max_tokens = min(msg.max_tokens or room, room)
        if max_tokens <= 0 or (self.strict_context and msg.max_tokens > room):
            raise RequestRejected(
                CONTEXT_LENGTH_EXCEEDED,
                f"this model's maximum context length is {self.context_length} tokens; the prompt has "
                f"{len(tokens)} tokens and max_tokens asks for {msg.max_tokens or 'the rest'}",
            )
        sampler, processors, out, grammar = self._decoding(msg, tokens[:prompt_tokens])
        cached, prefix = self._lookup(msg.rid, tokens)
        points = self.caches.snapshot_points(len(tokens), cached) if self.caches is not None else []
        cuts = [0] + [p - cached for p in points] + [len(tokens) - cached]
        if self.solo_on and not self._by_rid and not processors and msg.logprobs < 0 and not points:
            self._solo_uids -= 1  # the generator's uids count up from 0: a solo's are negative
            uid = self._solo_uids
            self._solo = Solo(self.model, uid, tokens, cached, prefix, max_tokens, sampler,
                              None if msg.ignore_eos else self._eos, self.graph)
            self._solo_plan = None  # predicted afresh, from what the fits know now
        else:
            self._solo_to_batch()
            (uid,) = self.gen.insert_segments(
                [[tokens[cached + a:cached + b] for a, b in zip(cuts, cuts[1:]) if b > a]],  # prefill stops at each point
                max_tokens=[max_tokens],
                caches=[prefix] if prefix is not None else None,
                all_tokens=[tokens[:cached]],
                samplers=[sampler],  # type: ignore[list-item]  # None: the greedy fallback
                logits_processors=[processors],
                stop_sequences=[self._stop_none if msg.ignore_eos else self._stop_eos],
            )
        req = Request(msg.rid, uid, prompt_tokens, out, completion_tokens=len(msg.resume_tokens),
                      cached_tokens=min(cached, prompt_tokens), prefill_left=len(tokens) - cached - 1, position=cached,
                      start=cached, snapshot_at=frozenset(points), grammar=grammar,
                      clamped=max_tokens < msg.max_tokens or not msg.max_tokens)
        self._by_uid[uid] = req
        self._by_rid[msg.rid] = req
        if req.prefill_left > 0:
            self._prefilling[msg.rid] = req

    def _resume_tokens(self, msg: Submit) -> list[int]:
        """A resumed request's earlier tokens, checked: ids this vocabulary has."""
        ids = msg.resume_tokens
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or 0 < self.vocab_size <= t for t in ids):
            raise RequestRejected(INVALID_REQUEST, "resume_tokens must be token ids of this model's vocabulary")
        return list(ids)

    def _lookup(self, rid: str, tokens: list[int]) -> tuple[int, list | None]:
        if self.caches is None:
            return 0, None
        try:
            return self.caches.lookup(tokens)
        except Exception:
            log.exception("[cache] rid=%s lookup failed; computing the whole prompt", rid)
            return 0, None

    def _take_snapshots(self, progress: list) -> None:
        """Copy the snapshot layers' state of the prompts whose prefill just stopped at a snapshot point."""
        if self.caches is None:
            return
        due = {}
        for p in progress:
            req = self._by_uid.get(p.uid)
            if req is not None and p.end_of_segment and not p.end_of_prompt:
                position = req.start + p.progress[0]
                if position in req.snapshot_at:
                    due[p.uid] = (req, position)
        if not due:
            return
        try:
            for uid, (cache, _) in self.gen.extract_cache(list(due)).items():
                req, position = due[uid]
                req.snapshots[position // self.caches.block - 1] = self.caches.snapshot(cache)
        except Exception:
            log.exception("[cache] taking a prefill snapshot failed; going on without it")

    def _store(self, tokens: list[int] | None, cache: list | None, snapshots: dict) -> None:
        if self.caches is None or not tokens or not cache:
            return
        try:
            self.caches.store(list(tokens), cache, snapshots)
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
        req = self._by_rid.pop(rid, None)
        if req is None:
            return False
        del self._by_uid[req.uid]
        self._prefilling.pop(rid, None)
        self._pending = [r for r in self._pending if r.uid != req.uid]
        if self._solo is not None and self._solo.uid == req.uid:
            self._solo = None
        elif req.uid >= 0:
            self.gen.remove([req.uid])
        return True

    def _solo_to_batch(self) -> None:
        """A second request came: the solo goes into the batch (solo.py says how no token is lost)."""
        solo, self._solo = self._solo, None
        if solo is None:
            return
        req = self._by_uid.pop(solo.uid)
        pending, cache, fed, rest = solo.hand_over()
        if pending is not None and pending.finish_reason is not None:  # that token ends it: it finishes next step
            pending.prompt_cache, pending.all_tokens = cache, fed
            self._by_uid[solo.uid] = req
            self._pending.append(pending)
            return
        (uid,) = self.gen.insert_segments(
            [[rest]], max_tokens=[solo.max_tokens - solo.generated], caches=[cache] if cache is not None else None,
            all_tokens=[fed], samplers=[solo.sampler], logits_processors=[[]],  # type: ignore[list-item]
            stop_sequences=[self._stop_eos if solo.eos is not None else self._stop_none])
        req.uid, req.start = uid, len(fed)
        self._by_uid[uid] = req
        if pending is not None:
            pending.uid = uid
            self._pending.append(pending)

    def _solo_step(self) -> tuple[list, list]:
        """The solo's step: a prefill chunk, or one token (generate_step's pipelining)."""
        solo = self._solo
        assert solo is not None
        req = self._by_uid[solo.uid]
        responses = solo.step(self.gen.prefill_step_size)
        req.position, req.prefill_left = min(solo.fed, solo.prompt_len), solo.prefill_left
        if not solo.prefill_left:
            self._prefilling.pop(req.rid, None)
        return [], responses

    # --- generation --------------------------------------------------------------------

    def _step_work(self) -> StepWork:
        """What the next step holds: the generator prefills the oldest prompts, prefill_batch_size at a time."""
        decoding = len(self._by_rid) - len(self._prefilling)
        if not self._prefilling or decoding >= self.max_batch_size:
            return StepWork(decoding, in_flight=self._in_flight)
        prefill = []
        for req in self._prefilling.values():
            prefill.append(PrefillSeq(req.prefill_left, req.position))
            if len(prefill) == self.prefill_batch_size:
                break
        return StepWork(decoding, tuple(prefill), self._in_flight)

    def plan_step(self) -> StepPlan:
        """Size the next step's prefill chunk to the step target; the plan says what it holds and its predicted time.
        A solo's decode step has nothing to size: one plan for all of them, and the fits learn from batches only."""
        if self._solo is not None and self._solo.decoding:
            if self._solo_plan is None:
                self._solo_plan = self.cost.predict(StepWork(1, in_flight=1), self.cost.min_chunk)
            self._plan = self._solo_plan
            return self._solo_plan
        plan = self._plan = self.cost.plan(self._step_work())
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
        failed mid-request)."""
        plan = self._plan or self.plan_step()
        self._plan = None
        t0 = time.perf_counter()
        progress, responses = self._solo_step() if self._solo is not None else self.gen.next()
        if plan is not self._solo_plan:
            self.cost.observe(plan, time.perf_counter() - t0)
        if self._pending:
            responses, self._pending = [*self._pending, *responses], []
        self._in_flight = plan.decoding  # their decode is computing; the next step waits for it
        self._hand_off()
        for p in progress:
            self._on_prefill_progress(p.uid, *p.progress)
        self._take_snapshots(progress)
        self.peak_batch_size = max(self.peak_batch_size, len(responses))
        chunks: list[list] = []
        finished: list[Finished | Failed] = self._grammar_failures()
        for r in responses:
            req = self._by_uid.get(r.uid)
            if req is None:
                continue
            reason = r.finish_reason
            if not (reason == "stop" and r.token in self._eos):
                req.completion_tokens += 1
                self.generated_tokens += 1
                req.unsent.append(r.token)
                req.out.push(r.token, r.logprobs)
                if req.out.stopped:
                    reason = "stop"
            if reason is None:
                if (chunk := req.out.take()) is not None:  # the ids of the tokens behind what it says go with it
                    chunks.append([req.rid, chunk[0], chunk[1], req.unsent, *chunk[2:]])
                    req.unsent = []
                continue
            text, extra, reason = req.out.finish(reason)
            if reason == "length" and req.clamped:
                reason = CONTEXT_WINDOW
            finished.append(Finished(req.rid, text, reason, req.prompt_tokens, req.completion_tokens,
                                     req.cached_tokens, req.unsent, extra))
            del self._by_uid[req.uid]
            del self._by_rid[req.rid]
            self._prefilling.pop(req.rid, None)
            if self._solo is not None and self._solo.uid == req.uid:
                cache, tokens = self._solo.release() if r.finish_reason is None else (r.prompt_cache, r.all_tokens)
                log.debug("[perf] solo rid=%s tokens=%d per_token_ms=%s", req.rid, self._solo.times.tokens,
                          self._solo.times.per_token_ms())
                self._solo = None
            elif r.finish_reason is None:  # a stop string ended it: the generator still runs it
                cache, tokens = self.gen.remove([req.uid], return_prompt_caches=True).get(req.uid, (None, None))
            else:
                cache, tokens = r.prompt_cache, r.all_tokens
            self._store(tokens, cache, req.snapshots)
        if not self._by_rid:
            self._hand_off()  # idle next: no step would hand them off, and none is in flight to wait for
        return chunks, finished

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
        """One step of the warm-up, if nothing is in flight: the decode graph's first trace, then the batch shapes
        (warmup.py); False once it is over."""
        warmer = self.warmer
        if len(self):
            return self._trace_graph or warmer is not None  # not now: later, when idle
        if self._trace_graph and self.graph is not None:
            self._trace_graph = False
            if self.graph.warm():
                log.info("[warm] model=%s decode_graph s=%.2f", self.model_id, self.graph.warm_s)
            return True
        if warmer is None:
            return False
        if warmer.step():
            return True
        self.warmer = None
        w = warmer.warmed
        log.info("[warm] model=%s batch_shapes sizes=%d steps=%d s=%.2f complete=%s", self.model_id,
                 len(w.decode_sizes), w.steps, w.seconds, w.complete)
        return False

    def close_caches(self) -> None:
        if self.caches is not None:
            self.caches.close()

    def settle(self) -> int:
        """Release what MLX holds in its buffer cache; return the process footprint left."""
        self._solo = None
        self._pending = []
        if self.warmer is not None:
            self.warmer.close()
            self.warmer = None
        self.gen.close()
        gc.collect()
        mx.clear_cache()
        return process_memory_bytes()
