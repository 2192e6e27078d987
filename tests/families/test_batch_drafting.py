"""Drafting inside the continuous batch gives plain decoding's tokens, exactly (issue 30; batch_drafting.py).

Real MLX on the CPU, the families' tiny models, the product's Engine driven by submit/step. Several requests decode
together, drafting in one verification, each row keeping its own count: a request starts alone (the solo, drafting),
a second joins (the solo's drafting goes into the batch with it), a third joins mid-way; one ends on max_tokens and
one on a stop token inside a draft while the others go on. Their ids must be those of drafting off, token for token,
where a trim undoes rejected drafts (llama), where the sliding window is full (gemma3: marked and re-fed) and where
recurrent layers cannot go back (qwen3_5), with every draft kept (the oracle) and with rejections at places that
differ from row to row (a partly wrong oracle, prompt lookup); every finishing row hands the prompt caches exactly
the tokens it emitted. Seeded sampled rows draft too and give plain seeded decoding's ids; unseeded sampled rows
draft. A JSON-constrained request drafts within its grammar (a draft it forbids ends the draft); a request with a
repetition penalty makes the batch's steps plain; a batch where drafting does not pay never drafts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.generate import StopSequences

from protocol.messages import Finished, Submit
from worker.mlx_engine import batch_drafting
from worker.mlx_engine.draft_pricing import Costs
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.guided import GrammarProcessor
from worker.mlx_engine.prompt_cache import CacheOptions
from worker.mlx_engine.speculative import Oracle, Speculation

BLOCK = [(i * 37) % 300 + 20 for i in range(30)]
PROMPTS = {"a": BLOCK * 3, "b": BLOCK[::-1] * 2, "c": BLOCK[5:] * 3, "g": BLOCK[:20]}  # repetitive: lookup finds drafts
LENGTHS = {"a": 60, "b": 13, "c": 30, "g": 12}
FREE = Costs(1.0, 1.0, 1.0, k=8)  # a verification as cheap as a plain step: whether drafting pays is not the point
JSON = {"type": "json", "schema": None}
FAMILIES = ["llama", "gemma3", "qwen3_5"]  # KV (trimmed), a full sliding window, recurrent layers (marked, re-fed)
Records = dict[str, list[int]]
# A step target no step misses: each prefill chunk is the whole prompt left (the cap) whatever this machine's speed and
# whatever the module's engines learnt in the tests before, so `together`'s schedule (which step each request joins
# at, where each is in its prompt then) is the same on a loaded machine and in any order: what is drafted and kept
# depends on it. Where in the batch a step falls is these tests' point, not the chunk sizing (tests/unit/test_step_cost.py).
ANY_STEP_S = 1e9


def steady(path: Path, **options: Any) -> Engine:
    """The tests' Engine: its prefill chunks pinned at the cap (ANY_STEP_S)."""
    return Engine(path, step_target_s=ANY_STEP_S, **options)


def greedy(rid: str, **kw: Any) -> Submit:
    return Submit(rid=rid, max_tokens=LENGTHS[rid], prompt_ids=PROMPTS[rid], **({"temperature": 0.0,
                                                                                "ignore_eos": True} | kw))


class Run:
    """Steps an engine, collecting each request's ids and Finished, and what each finishing row left the caches."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ids: dict[str, list[int]] = {}
        self.finished: dict[str, Finished] = {}
        self.stored: list[tuple[list[int], list, list[int]]] = []  # tokens, cache, the blocks of its snapshots

        def store(tokens: list[int] | None, cache: list | None, snapshots: dict, tail: bool = True) -> None:
            if tail:  # a finishing row's (tail=False: a prefill checkpoint's blocks, none here without caches)
                self.stored.append((list(tokens or []), cache or [], sorted(snapshots)))
        engine._store = store  # type: ignore[method-assign]

    def steps(self, n: int | None = None) -> None:
        while len(self.engine) and (n is None or n > 0):
            n = None if n is None else n - 1
            chunks, finished = self.engine.step()
            for chunk in chunks:
                self.ids.setdefault(chunk[0], []).extend(chunk[3])
            for f in finished:
                assert isinstance(f, Finished)
                self.ids.setdefault(f.rid, []).extend(f.token_ids)
                self.finished[f.rid] = f


def together(engine: Engine, records: Records | None = None, rids: str = "abc", stopping: str = "",
             constrained: str = "", penalised: str = "", **options: Any) -> Run:
    """The first request alone for 3 steps (the solo), then the second joins (the solo goes into the batch), and 6
    steps later the third; to the end. `records`: each request's own oracle (the target's output after its prompt,
    as recorded); the first started alone, with the engine's. `stopping`: the request that the EOS stops;
    `constrained`: the one whose output is JSON (a grammar: logits processors); `penalised`: the one with a
    repetition penalty (a logits processor that no drafting step applies); `options`: each Submit's others."""
    run = Run(engine)
    for rid, after in zip(rids, [3, 6][:len(rids) - 1] + [None]):
        engine.submit(greedy(rid, ignore_eos=rid != stopping, constraint=JSON if rid == constrained else None,
                             repetition_penalty=1.3 if rid == penalised else 1.0, **options))
        if records is not None and rid != rids[0]:
            engine.batch_drafts.rows[engine._by_rid[rid].uid].drafter = Oracle(records[rid])
        run.steps(after)
    return run


def partly_wrong(record: list[int], start: int) -> list[int]:
    """`record` with every fifth token past `start` changed: an oracle of it has drafts rejected at known places."""
    return [t + 1 if i > start and i % 5 == 0 else t for i, t in enumerate(record)]


def oracle(engine: Engine, records: Records) -> None:
    engine.speculation = Speculation("oracle", 4, oracle=records["a"])


@pytest.fixture(scope="module")
def plain(family_models: Path) -> dict[str, Engine]:
    return {name: steady(family_models / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def expected(plain: dict[str, Engine]) -> dict[str, dict[str, list[int]]]:
    """Each family's ids of the three requests with drafting off, in the same schedule."""
    return {name: together(engine).ids for name, engine in plain.items()}


@pytest.fixture(scope="module")
def drafting(family_models: Path) -> dict[str, Engine]:
    """Each family's engine with prompt lookup on, its costs pinned (the solo's and every batch size's)."""
    engines = {name: steady(family_models / name, speculative="prompt-lookup") for name in FAMILIES}
    for engine in engines.values():
        engine.speculation.pricing.costs = engine.batch_drafts.costs = FREE
    return engines


def exact_caches(run: Run, eos: int | None = None) -> None:
    """Every finishing row left the caches exactly its prompt and the tokens it emitted (an EOS it stopped on too)."""
    assert len(run.stored) == len(run.finished)
    by_tokens = {tuple(tokens): cache for tokens, cache, _ in run.stored}
    for rid, f in run.finished.items():
        tokens = (*PROMPTS[rid], *run.ids[rid], *([eos] if f.finish_reason == "stop" and eos is not None else []))
        assert tokens in by_tokens, rid
        attention = [c for c in by_tokens[tokens] if hasattr(c, "offset")]
        assert attention and all(c.offset == len(tokens) for c in attention), rid


@pytest.fixture
def keeps(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each drafting step's tokens kept, row by row (what batch_drafting.undo was asked to keep)."""
    seen: list[list[int]] = []
    undo = batch_drafting.undo

    def watched(model: Any, cache: list, ids: Any, keep: list[int], marked: Any) -> int:
        seen.append(list(keep))
        return undo(model, cache, ids, keep, marked)

    monkeypatch.setattr(batch_drafting, "undo", watched)
    return seen


SEEDED = {"temperature": 0.8, "seed": 11}


@pytest.mark.parametrize("name, options", [(name, {}) for name in FAMILIES] + [("llama", SEEDED), ("qwen3_5", SEEDED)],
                         ids=["llama", "gemma3", "qwen3_5", "llama-seeded", "qwen3_5-seeded"])
def test_rows_drafting_together_give_plain_decoding_s_ids(drafting: dict[str, Engine], plain: dict[str, Engine],
                                                          expected: dict, keeps: list[list[int]], name: str,
                                                          options: dict[str, Any]) -> None:
    """Every draft kept (the oracle: each row's own record), then drafts rejected at places that differ between the
    rows (a partly wrong record of each): each row keeps its own count, and the ids stay plain decoding's. Greedy
    rows, and sampled rows with a seed: they verify by their own draws, which are also their samplers in the batch."""
    engine, off = drafting[name], drafting[name].speculation
    want = together(plain[name], **options).ids if options else expected[name]
    if options:
        assert want != together(plain[name], **(options | {"seed": 12})).ids  # the seed matters
    records = {rid: PROMPTS[rid] + want[rid] for rid in "abc"}
    try:
        for kind in ("kept", "rejected"):
            if kind == "rejected":
                records = {rid: partly_wrong(r, len(PROMPTS[rid])) for rid, r in records.items()}
            oracle(engine, records)
            keeps.clear()
            run = together(engine, records, **options)
            assert run.ids == want
            for rid in "bc":  # in the batch only: their drafts were verified together with the others'
                f = run.finished[rid]
                assert f.accepted_tokens > 0 and (f.drafted_tokens == f.accepted_tokens) == (kind == "kept")
            assert any(len(set(k)) > 1 for k in keeps)  # rows keeping different numbers (a record's end, a rejection)
            exact_caches(run)
    finally:
        engine.speculation = off


def test_unseeded_sampled_rows_verify_by_the_standard_rule_in_the_batch(family_models: Path,
                                                                       keeps: list[list[int]]) -> None:
    """Sampled rows without a seed, drafting with a draft model that is the target itself: the drafts are drawn from
    the target's own distribution, so the standard rule (keep d with probability min(1, p(d) / q(d))) keeps nearly
    all of them, row by row in the batch; each row ends at its max_tokens, its cache holding exactly its tokens."""
    engine = steady(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=3)
    engine.speculation.pricing.costs = engine.batch_drafts.costs = FREE
    run = together(engine, temperature=0.7)
    assert {rid: len(ids) for rid, ids in run.ids.items()} == {rid: LENGTHS[rid] for rid in "abc"}
    assert any(len(k) > 1 for k in keeps)
    for rid in "bc":
        f = run.finished[rid]
        assert f.drafted_tokens > 0 and f.accepted_tokens >= 0.9 * f.drafted_tokens, rid
    exact_caches(run)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_stopping_inside_a_draft_ends_there_and_the_others_go_on(drafting: dict[str, Engine],
                                                                       plain: dict[str, Engine], expected: dict,
                                                                       name: str) -> None:
    """A token that `c` (or `b`) says made the EOS: the drafts run past it, but it ends exactly where plain decoding
    ends it, its cache holding the tokens up to there, while `a` decodes on."""
    engine, reference = drafting[name], plain[name]
    rid, at = next((r, i) for r in "cb" for i in range(5, len(expected[name][r]))
                   if expected[name][r][i] not in expected[name][r][:i])  # its first time there
    said, eos = expected[name][rid], expected[name][rid][at]
    for e in (engine, reference):  # the solo's stop set, the batch's stop sequences, and the solo's way into it
        e._eos, e._stop_eos = {eos}, StopSequences([[eos]])
        e.lane._stop_eos = e._stop_eos
    off = engine.speculation
    try:
        want = together(reference, stopping=rid).ids
        assert want[rid] == said[:at] and want["a"] == expected[name]["a"]
        records = {rid: PROMPTS[rid] + expected[name][rid] for rid in "abc"}
        oracle(engine, records)
        run = together(engine, records, stopping=rid)
        assert run.ids == want and run.finished[rid].finish_reason == "stop"
        assert run.finished["c"].accepted_tokens > 0 and run.finished["b"].accepted_tokens > 0
        exact_caches(run, eos)
    finally:
        for e in (engine, reference):
            e._eos = set(e.tokenizer.eos_token_ids)
            e._stop_eos = e.lane._stop_eos = StopSequences([[t] for t in sorted(e._eos)])
        engine.speculation = off


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_prompt_lookup_drafts_in_the_batch_and_gives_plain_decoding_s_ids(drafting: dict[str, Engine],
                                                                          expected: dict, name: str) -> None:
    """Each row drafts from its own history; rows disagree, drafts are rejected, the ids stay plain's, and a row's
    drafts run past its max_tokens, where it ends, its cache holding exactly the tokens it emitted."""
    run = together(drafting[name])
    assert run.ids == expected[name]
    assert sum(f.accepted_tokens for f in run.finished.values()) > 0
    assert sum(f.drafted_tokens - f.accepted_tokens for f in run.finished.values()) > 0
    exact_caches(run)


@pytest.fixture
def consumed(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Tokens each grammar's matcher consumed, net of those taken back (by the processor's id)."""
    counts: dict[int, int] = {}
    call, along, back = GrammarProcessor.__call__, GrammarProcessor.along, GrammarProcessor.back

    def called(self: GrammarProcessor, tokens: Any, logits: Any) -> Any:
        counts[id(self)] = counts.get(id(self), 0) + int(self._started and self.failure is None)
        return call(self, tokens, logits)

    def taken(self: GrammarProcessor, y: int, drafts: list[int]) -> Any:
        masks, n = along(self, y, drafts)
        counts[id(self)] = counts.get(id(self), 0) + (n + 1 if masks is not None else 0)
        return masks, n

    def given_back(self: GrammarProcessor, n: int) -> None:
        counts[id(self)] -= max(n, 0)
        back(self, n)

    monkeypatch.setattr(GrammarProcessor, "__call__", called)
    monkeypatch.setattr(GrammarProcessor, "along", taken)
    monkeypatch.setattr(GrammarProcessor, "back", given_back)
    return counts


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_constrained_request_drafts_within_its_grammar_and_gives_plain_decoding_s_ids(
        drafting: dict[str, Engine], plain: dict[str, Engine], keeps: list[list[int]], consumed: dict[int, int],
        name: str) -> None:
    """A JSON-constrained request drafts with two others: its drafts go as far as its grammar allows them and are
    verified against its masked logits, and its matcher is left as plain steps leave it: having consumed exactly the
    tokens emitted. Its record of plain constrained decoding (every draft kept), then a partly wrong one: the ids
    are plain decoding's."""
    engine, off = drafting[name], drafting[name].speculation
    want = together(plain[name], rids="abg", constrained="g").ids
    records = {rid: PROMPTS[rid] + want[rid] for rid in "abg"}
    accepted = []
    try:
        for kind in ("kept", "rejected"):
            if kind == "rejected":  # a wrong draft is forbidden (the draft ends there) or verified and rejected
                records = {rid: partly_wrong(r, len(PROMPTS[rid])) for rid, r in records.items()}
            oracle(engine, records)
            keeps.clear()
            consumed.clear()
            run = together(engine, records, rids="abg", constrained="g")
            assert run.ids == want
            assert list(consumed.values()) == [len(want["g"])]  # the matcher: exactly the tokens emitted
            g = run.finished["g"]
            assert g.accepted_tokens > 0 and (g.drafted_tokens == g.accepted_tokens or kind == "rejected")
            assert any(len(k) > 1 for k in keeps)  # g, constrained, never runs alone: it drafted in the batch
            accepted.append(g.accepted_tokens)
        assert accepted[1] < accepted[0]
    finally:
        engine.speculation = off


def test_a_draft_the_grammar_forbids_ends_the_draft(plain: dict[str, Engine]) -> None:
    """A constrained request's matcher, taken along a draft: it stops at the first token the grammar forbids, and
    what it consumed goes back out, leaving the request to decode on as plain decoding does."""
    engine = plain["llama"]
    want = together(engine, rids="g", constrained="g").ids["g"]
    engine.submit(greedy("g", constraint=JSON))
    got: list[int] = []
    while len(got) < 3:
        chunks, _ = engine.step()
        got += [t for c in chunks for t in c[3]]
    g = engine._by_rid["g"].grammar
    y = int(engine.gen._generation_batch._next_tokens[0].item())
    assert g is not None and g.drafts_ready()
    allowed = g.along(y, [])[0]
    assert allowed is not None
    g.back(1)
    forbidden = int(np.flatnonzero(allowed[0] == 0)[0])
    masks, consumed = g.along(y, [forbidden, forbidden])
    assert masks is not None and consumed == 0 and masks.shape[0] == 1  # the draft ends at the forbidden token
    g.back(1)
    run = Run(engine)
    run.steps()
    assert got + run.ids["g"] == want


def test_a_penalised_request_in_the_batch_makes_its_steps_plain(drafting: dict[str, Engine],
                                                                plain: dict[str, Engine]) -> None:
    """A request with a repetition penalty (a logits processor no drafting step applies) joins two drafting ones: no
    step drafts while it is in the batch, and every request's ids are plain's; the others draft before it comes."""
    engine = drafting["llama"]
    want = together(plain["llama"], rids="abg", penalised="g").ids

    def uids() -> set[int]:
        return set(engine.gen._generation_batch.uids)

    draft = engine.batch_drafts._draft
    seen: list[bool] = []  # for each drafting step: whether the penalised request was in the batch

    def watched(*args: object) -> list | None:
        g = engine._by_rid.get("g")
        seen.append(g is not None and g.uid in uids())
        return draft(*args)  # type: ignore[arg-type]

    engine.batch_drafts._draft = watched  # type: ignore[method-assign,assignment]
    try:
        run = together(engine, rids="abg", penalised="g")
    finally:
        del engine.batch_drafts._draft
    assert run.ids == want and run.finished["g"].drafted_tokens == 0
    assert seen and not any(seen) and run.finished["a"].accepted_tokens > 0


def test_a_batch_where_drafting_does_not_pay_never_drafts(plain: dict[str, Engine], expected: dict) -> None:
    """Verifying k + 1 tokens costs k + 1 plain steps at this batch size: even a draft kept whole would not pay, so
    the rows decode plainly; its costs are those of its size, measured once when not given."""
    engine, off = plain["llama"], plain["llama"].speculation
    try:
        engine.speculation = Speculation("prompt-lookup", 4)
        engine.speculation.pricing.costs = FREE  # the solo drafts; in the batch it stops
        engine.batch_drafts.costs = Costs(1.0, 2.0, 5.0, k=4)
        run = together(engine, rids="bc")
        assert run.ids == {rid: expected["llama"][rid] for rid in "bc"}
        assert run.finished["c"].drafted_tokens == 0
        engine.batch_drafts.costs = None
        run = together(engine, rids="bc")
        paces = [(p.pricing.rows, p.pricing.costs) for p in engine.batch_drafts._paces.values() if p.pricing]
        assert run.ids["c"] == expected["llama"]["c"] and any(rows == 2 and c is not None for rows, c in paces)
    finally:
        engine.speculation = off
        engine.batch_drafts.costs = None
        engine.batch_drafts._paces.clear()



def test_reply_snapshots_are_taken_where_plain_decoding_takes_them(family_models: Path) -> None:
    """With prompt caches, a hybrid's recurrent state is copied where a reply's cache fills a block: a drafting step
    keeps no more than reaches the next block's end, so every row ends with the snapshots plain decoding leaves."""
    options = CacheOptions(hot_bytes=1 << 26, block_tokens=16)
    want = together(steady(family_models / "qwen3_5", cache=options))
    engine = steady(family_models / "qwen3_5", cache=options, speculative="prompt-lookup")
    engine.speculation.pricing.costs = engine.batch_drafts.costs = FREE
    run = together(engine)
    assert run.ids == want.ids and sum(f.accepted_tokens for f in run.finished.values()) > 0
    assert sorted((t, s) for t, _, s in run.stored) == sorted((t, s) for t, _, s in want.stored)


def test_a_draft_model_drafts_for_every_row(family_models: Path, expected: dict) -> None:
    """Each row drafts with the draft model on its own cache (here the target itself: every draft kept)."""
    engine = steady(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=3)
    engine.speculation.pricing.costs = engine.batch_drafts.costs = FREE
    run = together(engine)
    assert run.ids == expected["llama"]
    assert all(f.drafted_tokens == f.accepted_tokens > 0 for f in run.finished.values())


def test_logprobs_of_drafted_tokens_are_plain_decoding_s(drafting: dict[str, Engine], plain: dict[str, Engine]) -> None:
    """A drafted token's logprobs come from the verification's position before it: the numbers plain decoding gives."""
    def logprobs(engine: Engine) -> tuple[dict[str, list], dict[str, Finished]]:
        said: dict[str, list] = {}
        finished = {}
        for rid in "ab":
            engine.submit(greedy(rid, logprobs=2))
        while len(engine):
            chunks, ended = engine.step()
            for chunk in chunks:
                said.setdefault(chunk[0], []).extend(chunk[4]["logprobs"])
            for f in ended:
                assert isinstance(f, Finished) and f.extra is not None
                said.setdefault(f.rid, []).extend(f.extra["logprobs"])
                finished[f.rid] = f
        return said, finished

    want, _ = logprobs(plain["llama"])
    got, finished = logprobs(drafting["llama"])
    assert finished["a"].accepted_tokens > 0 and got.keys() == want.keys()
    for rid in want:  # each token's text, its logprob and its top two, in order
        assert [[t for t, _ in top] for _, _, top in got[rid]] == [[t for t, _ in top] for _, _, top in want[rid]]
        numbers = [[lp, *(v for _, v in top)] for _, lp, top in got[rid]]
        assert numbers == [pytest.approx([lp, *(v for _, v in top)], abs=1e-4) for _, lp, top in want[rid]]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5"])
def test_a_lone_request_on_a_snapshot_model_runs_alone_and_leaves_the_batch_s_snapshots(family_models: Path,
                                                                                        name: str) -> None:
    """A request alone on a sliding-window or recurrent model with prompt caches decodes the generate_step way (the
    solo: mlx-lm's BatchGenerator at batch 1 costs ~1.5x a token on a GPU), its prefill chunks ending at the snapshot
    points and its drafting steps at the reply's block ends: the batch's ids, and the same snapshots left to the
    caches as the batch leaves. Before, such a request always went to the batch."""
    options = CacheOptions(hot_bytes=1 << 26, block_tokens=16, snapshot_every=32)

    def alone(engine: Engine) -> tuple[Run, bool]:
        run = Run(engine)
        engine.submit(greedy("a"))
        solo = engine._solo is not None
        run.steps()
        return run, solo

    want, solo = alone(steady(family_models / name, cache=options, solo="off"))
    assert not solo and want.stored[0][2]  # the batch's: prefill snapshots, a reply's
    drafts = steady(family_models / name, cache=options)
    drafts.speculation = Speculation("oracle", 4, oracle=PROMPTS["a"] + want.ids["a"])  # every draft kept: 5-token steps
    drafts.speculation.pricing.costs = FREE
    for engine in (steady(family_models / name, cache=options), drafts):
        run, solo = alone(engine)
        assert solo and run.ids == want.ids
        assert [s for *_, s in run.stored] == [s for *_, s in want.stored]  # the same snapshots, block for block
        (tokens, *_), (batch_tokens, *_) = run.stored[0], want.stored[0]  # the batch has fed its last token too
        assert tokens == batch_tokens[:len(tokens)] and len(tokens) >= len(batch_tokens) - 1
    assert run.finished["a"].accepted_tokens > 0


def test_a_lone_request_joining_the_batch_mid_prefill_keeps_its_snapshot_points(family_models: Path) -> None:
    """A second request arrives while the solo is between two of its snapshot points: the rest of its prompt goes to
    the batch cut at the points still ahead, so it leaves the caches the snapshots the batch alone would have."""
    options = CacheOptions(hot_bytes=1 << 26, block_tokens=16, snapshot_every=32)
    runs = []
    for solo in ("off", "auto"):
        run = Run(steady(family_models / "qwen3_5", cache=options, solo=solo))
        run.engine.submit(greedy("a"))
        run.steps(1)  # the solo: its prefill up to its first snapshot point (32)
        run.engine.submit(greedy("g"))
        run.steps()
        runs.append(run)
    assert runs[1].ids == runs[0].ids
    assert sorted(s for *_, s in runs[1].stored) == sorted(s for *_, s in runs[0].stored)
    assert any(s[:3] == [1, 3, 4] for *_, s in runs[1].stored)  # a's prefill snapshots at 32, 64 and 80
