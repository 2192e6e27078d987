"""One request alone, decoded the way mlx-lm's `generate_step` does it.

mlx-lm's BatchGenerator at batch 1 costs ~1.5x `stream_generate` per token on the GPU (its
batched caches, masks and bookkeeping). A request that arrives to an empty engine, and needs
nothing only the batch has (logits processors, logprobs), runs here instead: its prompt
prefilled in chunks (one per engine step, sized by the step cost model as the batch's are, each
ending no further than the next of its snapshot points: a sliding-window or recurrent model's
caches copy those layers' state there, snapshots.py), then one token per step, pipelined as
generate_step is: the step for token n+1 is scheduled (`mx.async_eval`) before token n is read,
with the same ops on the same stream, so its greedy tokens are generate_step's.

When a second request arrives, `hand_over` ends the solo: the token in flight is evaluated
and returned (the engine emits it), and the cache holding every token fed so far goes to the
BatchGenerator as the request's starting cache, with the tokens not yet fed (the emitted
token, or the rest of the prompt) as its prompt: no token is lost or repeated, and what
follows is the batch's.

With a `Drafting` (speculative.py), a decode step may instead read the token in hand, draft up to k tokens after
it, run the model once on all of them, and emit the token and the drafts kept, in order and stopping exactly
where plain decoding would (an EOS, max_tokens); the target's next token is the one in hand for the next step,
not yet fed, as a plain step leaves it, so a hand-over mid-drafting finds the cache holding exactly the tokens
emitted. Where plain steps run compiled, so does the verification (`DecodeGraph.verify`: one trace per length and
capacity), and rejected drafts are rolled back in the graph's state (its fill goes back): the cache stays in the
graph whether a step drafts or not, written back only when the solo ends. Layers a trim cannot undo (recurrent
state, a full sliding window) are marked before the verification and given back after a rejection, and the kept
tokens are fed again in one forward pass (rollback.py); its logits are not needed: the token after them is the
one the verification chose. A seeded request samples with its drafting's `Draws`, which the verification draws
from too, so its stream stays where plain decoding's would be (and goes on so in the batch after a hand-over).

On CUDA (`--solo ahead`, auto there) the graph of the next decode step may be built ahead, on a thread of its own
(`Ahead`), while the main thread launches the step before it. Its `Pace` (worker/pace.py) decides, step by step, from
the decode steps' own times: on the GPU host building ahead was faster in the host's slow speed and slower in its fast
one (bench/results/gpu/itl-s18/). Why it can pay: one stream is bound by the main thread's CPU, which
builds a token's graph in Python (~40% of a token on the GPU host) and then launches it in `mx.async_eval`, which
releases the GIL. The build ahead feeds the token in flight (lazy) to the cache; the main thread waits for it as the
launch returns (so the thread never runs beside the main thread's other MLX work) and takes the built graph at its
next step, as if it had fed it then. It runs only where it can be undone exactly: plain steps (not
compiled, no drafts, no reply snapshots) on caches that are all KVCache (not a quantized running cache), for a
request that is not seeded (an undone build would have drawn from its sampler's stream). `settle` undoes it (the
caches' offsets put back; what it wrote lies past them, as after a trim) before anything reads or hands on the
cache: an EOS or a stop string ends the
request, the batch takes it over, an abort drops it. Its graphs go on the main thread's generation stream, where
the main thread evaluates them (mlx-lm's `generation_stream` is one stream per thread), and their ids are plain
decoding's. On the GPU host, at its slow speed, it took a lone request's tokens from 1.055 to 0.93 of generate_step's
time in one process (`python -m bench.solo_vs_sg`), and served over HTTP 1.10-1.17x the tokens a second of the same
tree without it (bench/results/gpu/itl-s17/); at its fast speed it cost ~10% (itl-s18/), hence the Pace. Removed
once (45a74e6) as inside the noise, it came back when 5 interleaved pairs showed mlxsup's one-stream ITL over
in-process mlx-lm going from 0.916 to 1.184 without it, every run after above every run before
(bench/results/gpu/structure-ab/).

`SoloLane` is the engine's side of it: the solo in flight (at most one), its start, the hand-over into the
engine's BatchGenerator, and the token read at a hand-over, which the engine emits at its next step.

Invariants: `fed` tokens are in the cache (its offset) and are `tokens[:fed]`, once a build ahead is settled (while
one runs, the Ahead thread holds the cache, and `fed` does not count its token); a finished solo hands its cache and
exactly those tokens to the prompt caches; main thread only, but for the build ahead.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences, generation_stream
from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker.job_thread import JobThread
from worker.mlx_engine.decode_graph import DecodeGraph, DecodeState
from worker.mlx_engine.rollback import mark, restore, trim, undoable
from worker.mlx_engine.speculative import Drafting
from worker.mlx_engine.taps import tap_of
from worker.pace import Pace

if TYPE_CHECKING:
    from worker.mlx_engine.request import EngineRequest


@dataclass(slots=True)
class SoloResponse:
    """What a BatchGenerator response carries, as the engine reads it."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None  # "stop" (an EOS), "length", or None
    prompt_cache: list | None = None
    all_tokens: list[int] | None = None


_GC = [0.0, 0.0]  # seconds this process spent in the garbage collector, the start of the collection under way


def _gc_timer(phase: str, _info: dict) -> None:
    if phase == "start":
        _GC[1] = time.perf_counter()
    else:
        _GC[0] += time.perf_counter() - _GC[1]


gc.callbacks.append(_gc_timer)


@dataclass(slots=True)
class SoloTimes:
    """Where a solo's decode steps spend their wall time (seconds, summed over `tokens` steps): building and
    launching the next token's graph (`feed`), waiting for the token in flight (`read`), and everything between
    two steps outside them (`outside`: the engine's output handling, the worker loop, its sends); `gc`: the
    garbage collector's share of those, from the first token on (inside any of them)."""

    tokens: int = 0
    feed: float = 0.0
    read: float = 0.0
    outside: float = 0.0
    _last_end: float | None = field(default=None, repr=False)
    _gc0: float = field(default=0.0, repr=False)

    def per_token_ms(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        out = {k: round(getattr(self, k) / n * 1e3, 4) for k in ("feed", "read", "outside")}
        out["gc"] = round((_GC[0] - self._gc0) / n * 1e3, 4) if self.tokens else 0.0
        return out


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class Ahead(JobThread):
    """The thread a solo's next decode graph is built on while the main thread launches the one before it (made on
    the main thread: its graphs go on the main thread's generation stream, where the main thread evaluates them;
    mlx-lm's `generation_stream` is one stream per thread)."""

    def __init__(self) -> None:
        super().__init__("mlxsup-ahead")
        with mx.stream(generation_stream):
            self.stream = mx.default_stream(mx.default_device())
        # whether building ahead is faster than not on this host now, measured on the solos' steps (None: always)
        self.pace: Pace | None = Pace()

    def use(self) -> bool:
        return self.pace is None or self.pace.use()

    def build(self, fn: Callable[..., Any], *args: Any) -> None:
        self.start(self._on_stream, fn, args)

    def _on_stream(self, fn: Callable[..., Any], args: tuple) -> Any:
        with mx.stream(self.stream):
            return fn(*args)


class Solo:
    def __init__(self, model: nn.Module, uid: int, tokens: list[int], cached: int, cache: list | None,
                 max_tokens: int, sampler: Callable | None, eos: set[int] | None,
                 graph: DecodeGraph | None = None, drafting: Drafting | None = None, stops: frozenset[int] = frozenset(),
                 boundary: int = 0, ahead: Ahead | None = None) -> None:
        self.model = model
        self.uid = uid
        self.tokens = list(tokens)  # the prompt, then each generated token once it is fed
        self.prompt_len = len(tokens)
        self.fed = cached  # tokens whose K/V is in the cache
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.max_tokens = max_tokens
        # None: greedy; a seeded request that drafts samples with its draws, which verification uses too
        self.sampler = drafting.draws if drafting is not None and drafting.draws is not None else sampler
        self.eos = eos  # None: EOS does not stop it (ignore_eos)
        self.generated = 0
        self._next: tuple[mx.array, mx.array] | None = None  # the token in flight and its logprobs
        self.graph = graph  # decode steps compiled (decode_graph.py), if the model's caches allow it
        self._state: DecodeState | None = None  # the cache while the graph holds it
        self.times = SoloTimes()
        self.drafting = drafting  # None: no drafts (never asked for, or this request's caches cannot roll back)
        # the target's hidden states, for a drafter that reads them (taps.py): each forward pass's goes to
        # it (`_seen`); such a solo never builds ahead (a build's hidden state would be the other thread's)
        self._tap = tap_of(model) if drafting is not None and getattr(drafting.drafter, "taps", False) else None
        if self._tap is not None:
            ahead = None
        self.stops = sorted(stops)  # prompt positions where its prefill stops for a cache snapshot (the engine's)
        self.boundary = boundary  # reply snapshots are taken where the cache fills a multiple of it (0: none)
        # where the graph after the one launched is built meanwhile (None: never); only on caches that are all KVCache,
        # whose state before a build can be put back exactly (a quantized running cache, quantized_kv.py's QuantizedKV,
        # is not built ahead: its undo is not tested)
        self.ahead = ahead if ahead is not None and all(type(c) is KVCache for c in self.cache) else None
        if self.ahead is not None and self.ahead.pace is not None:
            self.ahead.pace.begin()
        # the last decode step, if it ran wholly one way (built ahead after a step that did, or not after one that did
        # not): that way, and its start
        self._timed: tuple[bool, float] | None = None
        self._saved: list[tuple[mx.array, mx.array, int]] | None = None  # the cache before that build, until taken
        self._built: tuple[mx.array, mx.array] | None = None  # that build's graph: its token and logprobs

    @property
    def prefill_left(self) -> int:
        return max(0, self.prompt_len - 1 - self.fed)

    @property
    def decoding(self) -> bool:
        return self._next is not None

    def _feed(self, ids: mx.array) -> tuple[mx.array, mx.array]:
        """generate_step's `_step` (on the generation stream: `step` runs there): the next token (scheduled, not
        evaluated) and its logprobs. Single tokens go through the compiled graph where there is one."""
        if ids.size == 1:
            self._compiled()
        if self._state is not None:
            assert self.graph is not None
            logprobs = self.graph.feed(self._state, ids)
            self._seen(self.fed)
            token = (self.sampler or _greedy)(logprobs)
            self.fed += ids.size
            return token, logprobs.squeeze(0)
        self.fed += ids.size
        return self._build(ids)

    def _build(self, ids: mx.array) -> tuple[mx.array, mx.array]:
        """The model's graph for `ids` on the solo's cache, uncompiled: the next token and its logprobs."""
        logits = self._run(ids, self.fed - ids.size)[:, -1, :]  # (`fed` counts them already)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return (self.sampler or _greedy)(logprobs), logprobs.squeeze(0)

    def _run(self, ids: mx.array, start: int) -> mx.array:
        """The model's logits for `ids` fed at position `start`, uncompiled; their hidden states to the drafter that
        reads them."""
        if self._tap is None:
            return self.model(ids[None], cache=self.cache)
        self._tap.clear()
        self._tap.on = True
        try:
            logits = self.model(ids[None], cache=self.cache)
        finally:
            self._tap.on = False
        self._seen(start)
        return logits

    def _seen(self, start: int) -> None:
        """The last forward pass's hidden states (from position `start`) to the drafter that reads them."""
        hidden = self._tap.take() if self._tap is not None else None
        if hidden is not None:
            if self.drafting is not None:
                self.drafting.drafter.see(start, hidden, self.tokens)  # type: ignore[attr-defined]

    def _ahead_ok(self) -> bool:
        """Whether the next token's graph may be built ahead: plain steps (no compiled graph, no drafting step next,
        no reply snapshots) with an Ahead thread (the caches allow it)."""
        return self.ahead is not None and self.graph is None and not self.boundary and (
            self.drafting is None or not self.drafting.soon(self.generated + 1))

    def _launch_with_build_ahead(self, built_too: tuple[mx.array, mx.array]) -> None:
        """Launch `built_too` (the graph that makes the next token) while the Ahead thread builds the graph that feeds
        that token, and wait for that build before going on: the Ahead thread runs inside the launch's release of the
        GIL only, never beside the main thread's other MLX work."""
        assert self.ahead is not None
        self._saved = [(c.keys, c.values, c.offset) for c in self.cache]
        self.ahead.build(self._build, built_too[0])
        mx.async_eval(*built_too)
        try:
            self._built = self.ahead.collect()
        except Exception:
            self._restore()
            raise

    def _take_ahead(self) -> tuple[mx.array, mx.array]:
        """The graph built ahead, which fed the token now in hand: from here on as if this step had fed it."""
        built, self._built, self._saved = self._built, None, None
        assert built is not None
        self.fed += 1
        return built

    def settle(self) -> None:
        """Undo a graph built ahead and not taken: the caches' offsets as plain decoding leaves them. What the build
        wrote lies past them, as after a trim (mlx-lm's KVCache writes in place), and its lazy forward pass is left in
        the caches' graph: one token's work, done when they are next evaluated. Before anything reads or hands on
        the cache."""
        if self._saved is not None:
            self._restore()

    def _restore(self) -> None:
        saved, self._saved, self._built = self._saved, None, None
        assert saved is not None
        for c, (keys, values, offset) in zip(self.cache, saved, strict=True):
            c.keys, c.values, c.offset = keys, values, offset

    def _compiled(self) -> bool:
        """Whether the graph holds the cache (taken into it here if it can)."""
        if self._state is None and self.graph is not None:
            if self.graph.fits(self.cache):
                self._state = self.graph.start(self.cache)
            elif self.fed:  # filled and still not fit: this model's caches cannot run compiled; decided once
                self.graph = None
        return self._state is not None

    def _mark(self, n: int) -> Any:
        """What undoing some of the next n tokens fed needs beyond a trim (None: nothing): the graph's recurrent state
        (the step replaces it, never writes into it), or the marked layers' (rollback.py)."""
        if self._state is not None:
            return self._state.arrays or None
        return mark(self.cache, n)

    def _undo(self, fed: int, kept: list[int], marked: Any) -> int:
        """Keep only `kept`, the first of the last `fed` tokens fed: trimmed back where a trim does it, else the marked
        state given back, the other layers trimmed by all `fed`, and `kept` fed again. The tokens fed again."""
        if fed == len(kept):
            return 0
        self.fed -= fed - len(kept)
        if marked is None:
            if self._state is not None:
                assert self.graph is not None
                self.graph.rollback(self._state, fed - len(kept))
            else:
                trim(self.cache, fed - len(kept))
            return 0
        ids = mx.array(kept, mx.uint32)
        if self._state is not None:
            assert self.graph is not None
            self.graph.rollback(self._state, fed, marked)
            self.graph.verify(self._state, ids)
            self._seen(self.fed - len(kept))
        else:
            restore(self.cache, marked, fed)
            self._run(ids, self.fed - len(kept))
        return len(kept)

    def step(self, chunk: int) -> list[SoloResponse]:
        """One engine step: a prefill chunk of at most `chunk` tokens, or one token out. All of it on the generation
        stream, as generate_step runs its loop: an eval outside it (`async_eval`, `item`) synchronises through the
        default stream, which cost a token ~0.5 ms on MLX CUDA (1.18x generate_step; bench/solo_vs_sg.py)."""
        with mx.stream(generation_stream):
            return self._step(chunk)

    def _step(self, chunk: int) -> list[SoloResponse]:
        if self._next is None and self.prefill_left > 0:
            n = min(max(1, chunk), self.prefill_left, *(p - self.fed for p in self.stops if p > self.fed))
            self._run(mx.array(self.tokens[self.fed:self.fed + n]), self.fed)
            mx.eval([c.state for c in self.cache])
            self.fed += n
            mx.clear_cache()  # as generate_step: a chunk's transient buffers go back, not to MLX's buffer cache
            return []
        if self._next is None:  # the prompt's last token, fed uncompiled as generate_step feeds it: the first token
            # out waits for no decode graph (taking the cache in copies it, and a capacity new to the worker is traced:
            # 17 ms against an 8 ms forward pass, a tiny model 6k tokens in, on this CPU); the next token's step takes
            # the cache into the graph
            ids = mx.array(self.tokens[self.fed:self.prompt_len])
            self.fed += ids.size
            self._next = self._build(ids)
            mx.async_eval(*self._next)
        if self.drafting is not None and (drafted := self._draft_step()) is not None:
            return drafted
        times, t0 = self.times, time.perf_counter()
        if self._timed is not None and self.ahead is not None and self.ahead.pace is not None:
            self.ahead.pace.record(t0 - self._timed[1], self._timed[0])  # the last step's time, in its way
        token, logprobs = self._next
        way, began_built = None, self._saved is not None
        if self.generated + 1 < self.max_tokens:  # another token will be wanted: schedule it before reading this one
            self._next = self._take_ahead() if began_built else self._feed(token)
            if self.generated + 2 < self.max_tokens and self._ahead_ok():  # and one after it may be built during
                way = cast(Ahead, self.ahead).use()  # the launch: where that is faster now
            if way:
                self._launch_with_build_ahead(self._next)
            else:
                mx.async_eval(*self._next)
        else:
            self._next = None
        self._timed = (way, t0) if way is not None and way == began_built else None
        if self.generated % 256 == 0:
            mx.clear_cache()  # as generate_step
        t1 = time.perf_counter()
        value = cast(int, token.item())
        t2 = time.perf_counter()
        if times._last_end is not None:
            times.outside += t0 - times._last_end
        else:
            times._gc0 = _GC[0]
        times.tokens += 1
        times.feed += t1 - t0
        times.read += t2 - t1
        times._last_end = t2
        return [self._out(value, logprobs)]

    def _draft_step(self) -> list[SoloResponse] | None:
        """The token in hand, and the drafts after it that verification keeps; None: a plain step instead (no draft
        now). The cache is rolled back to the tokens emitted, the target's token after them is the next in hand."""
        d = self.drafting
        assert d is not None and self._next is not None
        if not d.wants(self.generated) or self._saved is not None:  # (a graph built ahead feeds the token in hand)
            return None
        space = d.drafter.room() if undoable(self.cache) else 0  # the cache's kinds: the same in the graph
        if space < 2:  # no rollback possible (a draft model's window full...), for the rest of the request
            self.drafting = None
            return None
        if not d.priced(self.model, self.graph, self.generated):  # it would not pay: plain decoding is faster here
            return None
        y_arr, y_logprobs = self._next
        y = cast(int, y_arr.item())
        k = min(d.length(d.k), self.max_tokens - self.generated - 1, space - 1)
        if self.boundary:  # a step ends no further than the next reply-snapshot boundary, as plain steps meet each
            k = min(k, self.boundary - self.fed % self.boundary - 1)
        if k < 1 or (self.eos is not None and y in self.eos):
            return None
        drafts, q = d.drafter.propose(self.tokens, y, k, d.sampling, d.draft_keys(k))
        d.proposed(drafts is not None, self.generated)
        if drafts is None:
            return None
        k = drafts.size
        ids = mx.concatenate([y_arr.astype(mx.uint32).reshape(1), drafts])
        compiled = self._compiled()
        marked = self._mark(k + 1)
        if compiled:
            assert self.graph is not None and self._state is not None
            logprobs = self.graph.verify(self._state, ids)
            self._seen(self.fed)
        else:
            logits = self._run(ids, self.fed)[0]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.fed += k + 1
        kept, after = d.verify(logprobs, drafts, q)
        emitted = [y, *cast(list[int], drafts[:kept].tolist())]
        if self.eos is not None:  # plain decoding stops at an EOS among the kept drafts: nothing after it is emitted
            emitted = emitted[:next((i + 1 for i, t in enumerate(emitted) if t in self.eos), len(emitted))]
        refed = self._undo(k + 1, emitted, marked)  # the cache holds the tokens emitted, as `_out` expects
        d.drafter.keep(len(self.tokens) + len(emitted))
        d.observe(k, kept, self.generated, refed)
        out = [self._out(token, y_logprobs if i == 0 else logprobs[i - 1]) for i, token in enumerate(emitted)]
        if out[-1].finish_reason is not None:
            self._next = None
            return out
        self._next = (mx.array([after], mx.uint32), logprobs[kept])
        self.times._last_end = time.perf_counter()
        return out

    def _out(self, token: int, logprobs: mx.array) -> SoloResponse:
        """The response for a token just read; a finishing one carries the cache and the tokens fed."""
        self.generated += 1
        if self.fed > len(self.tokens):  # it was fed already (its successor is in flight)
            self.tokens.append(token)
        reason = "stop" if self.eos is not None and token in self.eos else (
            "length" if self.generated >= self.max_tokens else None)
        r = SoloResponse(self.uid, token, logprobs, reason)
        if reason is not None:
            self.settle()
            r.prompt_cache, r.all_tokens = self._cache(), self.tokens[:self.fed]
        return r

    def release(self) -> tuple[list, list[int]]:
        """The cache and the tokens in it, for the prompt caches (a stop string ended it)."""
        self.settle()
        if self._next is not None:
            with mx.stream(generation_stream):
                mx.eval(self._next[0])
            self._next = None
        return self._cache(), self.tokens[:self.fed]

    def hand_over(self) -> tuple[SoloResponse | None, list | None, list[int], list[int]]:
        """End the solo for the batch: (the token in flight as a response, or None; the cache, or None when
        nothing was fed; the tokens in it; the tokens still to feed, which the batch takes as its prompt)."""
        self.settle()
        pending = None
        if self._next is not None:
            token, logprobs = self._next
            self._next = None
            with mx.stream(generation_stream):
                pending = self._out(cast(int, token.item()), logprobs)
            rest = [pending.token]
        else:
            rest = self.tokens[self.fed:self.prompt_len]
        return pending, self._cache() if self.fed else None, self.tokens[:self.fed], rest

    def cache_now(self) -> list:
        """The cache with every token fed, the solo going on (the engine's snapshot of a reply's state)."""
        self.settle()
        return self._cache()

    def _cache(self) -> list:
        """The cache with every token fed, taken back from the graph if it holds it."""
        if self._state is not None:
            assert self.graph is not None
            self.graph.write_back(self._state, self.cache)
        return self.cache


class SoloLane:
    """The engine's solo, if a request is alone, and its way into the engine's generator when another comes."""

    def __init__(self, model: nn.Module, gen: BatchGenerator, stop_eos: StopSequences, stop_none: StopSequences,
                 graph: DecodeGraph | None = None, boundary: int = 0, ahead: bool = False) -> None:
        self.model = model
        self.graph = graph  # each solo's decode steps compiled (None: never)
        self.boundary = boundary  # reply snapshots where a solo's cache fills a multiple of it (0: none)
        self.ahead = Ahead() if ahead else None  # each solo's next graph built during the last one's launch
        self._gen = gen
        self._stop_eos, self._stop_none = stop_eos, stop_none
        self.solo: Solo | None = None
        self.pending: list[SoloResponse] = []  # a solo's token read when it joined the batch, emitted next step
        self._uids = 0

    def start(self, r: EngineRequest, cached: int, cache: list | None, points: list[int], eos: set[int]) -> int:
        """A request alone runs as the solo, `cached` of its tokens in `cache`, its prefill stopping at `points`, ended
        by `eos` (the engine's; unless it ignores EOS); its uid (negative: the generator's count up from 0). The
        batch's start (batch_lane.py's BatchLane.start) takes the same, its EOS as the generator's stop sequences.
        A seeded one never builds ahead: a build undone would have drawn from its sampler's stream, which the batch
        goes on with."""
        self._uids -= 1
        self.solo = Solo(self.model, self._uids, r.tokens, cached, cache, r.max_tokens, r.decoding.sampler,
                         None if r.ignore_eos else eos, self.graph, r.drafting, frozenset(points), self.boundary,
                         None if r.seeded else self.ahead)
        return self._uids

    def to_batch(self) -> tuple[int, int, int] | None:
        """A second request came: the solo goes into the generator (the module's docstring says how no token is
        lost). (its uid as the solo, its uid in the generator, the tokens in its starting cache); None when there
        was no solo, or the token in flight ends it (it stays pending, and finishes at the next step)."""
        solo, self.solo = self.solo, None
        if solo is None:
            return None
        pending, cache, fed, rest = solo.hand_over()
        if pending is not None and pending.finish_reason is not None:
            pending.prompt_cache, pending.all_tokens = cache, fed
            self.pending.append(pending)
            return None
        cuts = [0, *(p - len(fed) for p in solo.stops if len(fed) < p < len(fed) + len(rest)), len(rest)]
        (uid,) = self._gen.insert_segments(  # the prompt's rest stops at its snapshot points, as in the solo
            [[rest[a:b] for a, b in zip(cuts, cuts[1:])]], max_tokens=[solo.max_tokens - solo.generated], caches=[cache] if cache is not None else None,
            all_tokens=[fed], samplers=[solo.sampler], logits_processors=[[]],  # type: ignore[list-item]
            stop_sequences=[self._stop_eos if solo.eos is not None else self._stop_none])
        if pending is not None:
            pending.uid = uid
            self.pending.append(pending)
        return solo.uid, uid, len(fed)

    def drop(self, uid: int) -> bool:
        """Forget a request (aborted): its pending token, and the solo if it is that one; True if it was."""
        self.pending = [r for r in self.pending if r.uid != uid]
        if self.solo is not None and self.solo.uid == uid:
            self.solo.settle()  # its graph built ahead, if any, is the next solo's to wait for no more
            self.solo = None
            return True
        return False

    def computed(self, uid: int) -> tuple[list | None, list[int] | None]:
        """What the solo computed (its cache and the tokens in it), for an abort: its token in flight read."""
        assert self.solo is not None and self.solo.uid == uid
        return self.solo.release()

    def row(self, uid: int, layers: Any) -> tuple[list, list[int]]:
        """The solo's cache as it stands mid-prefill, for a prefill checkpoint (checkpoints.py)."""
        solo = self.solo
        assert solo is not None and solo.uid == uid
        return solo.cache, solo.tokens[:solo.fed]

    def finish(self, uid: int, r: SoloResponse) -> tuple[list | None, list[int] | None]:
        """The solo ended at `r` (a stop string, when it says no reason): its cache and tokens, for the caches."""
        solo, self.solo = self.solo, None
        assert solo is not None and solo.uid == uid
        return solo.release() if r.finish_reason is None else (r.prompt_cache, r.all_tokens)

    def close(self) -> None:
        if self.solo is not None:
            self.solo.settle()
        self.solo = None
        self.pending = []
        if self.ahead is not None:
            self.ahead.close()
