"""Drafting in the solo gives plain decoding's tokens, exactly (issue 30, first slice).

Real MLX on the CPU, the families' tiny models, the product's Engine driven by submit/step. Greedy ids with
drafting on (prompt lookup, a draft model, the oracle) must be those with it off, token for token: where a trim
undoes rejected drafts (KV caches: llama, qwen3) and where it cannot (qwen3_5's recurrent layers, gemma3's full
sliding window: marked and re-fed, rollback.py), compiled and not; across a hand-over into the batch right after a
step that rejected drafts; ending exactly at max_tokens, an EOS and a stop string. A seeded sampled request gives
plain seeded decoding's ids, whole and resumed, and a draft that keeps nothing stops being asked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from protocol.messages import Finished, Submit
from worker.mlx_engine.draft_pricing import Costs
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.speculative import MIN_VERIFIES, ModelDrafter, PromptLookup, Record, Sampling, Speculation

BLOCK = [(i * 37) % 300 + 20 for i in range(30)]
PROMPT = BLOCK * 3  # repetitive, as code an agent was shown and edits: prompt lookup finds drafts in it


def run(engine: Engine, msg: Submit, until: int | None = None) -> tuple[list[int], Finished | None]:
    """Submit `msg` and step until it finished (or has `until` ids): its ids and its Finished."""
    engine.submit(msg)
    return drive(engine, msg.rid, until)


def drive(engine: Engine, rid: str, until: int | None = None, got: dict | None = None) -> tuple[list[int], Finished | None]:
    got = {} if got is None else got
    fin = None
    while len(engine) and (until is None or len(got.get(rid, [])) < until):
        chunks, finished = engine.step()
        for chunk in chunks:
            got.setdefault(chunk[0], []).extend(chunk[3])
        for f in finished:
            got.setdefault(f.rid, []).extend(f.token_ids)
            fin = f if f.rid == rid else fin
    return got.get(rid, []), fin


FREE = Costs(1.0, 1.0, 1.0, k=8)  # a verification as cheap as a plain step: drafting pays at 0.1 kept per verification


def drafting(path: Path, **kw: object) -> Engine:
    """An engine that drafts, its costs pinned: whether drafting pays on this (loaded) CPU is not these tests' concern."""
    engine = Engine(path, **kw)  # type: ignore[arg-type]
    engine.speculation.pricing.costs = FREE
    return engine


def greedy(rid: str = "a", prompt: list[int] = PROMPT, n: int = 60, **kw: object) -> Submit:
    return Submit(rid=rid, max_tokens=n, prompt_ids=prompt, temperature=0.0, **({"ignore_eos": True} | kw))


def partly_wrong(record: list[int], start: int) -> list[int]:
    """`record` with every fifth token past `start` changed: an oracle of it has drafts rejected at known places."""
    return [t + 1 if i > start and i % 5 == 0 else t for i, t in enumerate(record)]


@pytest.fixture(scope="module")
def drafts(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama's tokenizer with other weights (`other`: a draft that keeps almost nothing), and a llama of another
    seed (`foreign`: another tokenizer)."""
    from worker.mlx_engine.make_model import make_model

    root = tmp_path_factory.mktemp("drafts")
    make_model(root / "foreign", "tiny", seed=1, arch="llama")
    shutil.copytree(family_models / "llama", root / "other")
    for f in (root / "foreign").glob("*.safetensors"):
        shutil.copy(f, root / "other" / f.name)
    return root


@pytest.fixture(scope="module")
def plain(family_models: Path) -> dict[str, Engine]:
    """Each family's engine with drafting off: the reference."""
    return {name: Engine(family_models / name) for name in ("llama", "qwen3", "gemma3", "qwen3_5")}


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_5"])
def test_prompt_lookup_keeps_drafts_and_gives_plain_decoding_s_ids(family_models: Path, plain: dict,
                                                                   name: str) -> None:
    expected, _ = run(plain[name], greedy())
    engine = drafting(family_models / name, speculative="prompt-lookup")
    got, fin = run(engine, greedy())
    assert fin is not None and fin.accepted_tokens > 0 and fin.drafted_tokens >= fin.accepted_tokens
    assert got == expected and fin.completion_tokens == 60


def test_a_draft_model_keeps_what_the_target_says_and_nothing_else(family_models: Path, plain: dict,
                                                                   drafts: Path) -> None:
    expected, _ = run(plain["llama"], greedy())
    itself = drafting(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=3)
    got, fin = run(itself, greedy())
    assert got == expected and fin is not None and fin.drafted_tokens == fin.accepted_tokens > 0  # the same model
    assert itself.weights_bytes == 2 * plain["llama"].weights_bytes  # admission sees the draft's weights
    other = drafting(family_models / "llama", speculative="draft", draft=drafts / "other")
    got, fin = run(other, greedy())
    assert got == expected and fin is not None and fin.drafted_tokens > fin.accepted_tokens


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5"])
def test_a_draft_model_whose_layers_a_trim_cannot_undo_drafts_and_gives_plain_decoding_s_ids(
        family_models: Path, plain: dict, name: str) -> None:
    """A draft model with recurrent layers (qwen3_5) or a full sliding window (gemma3's is 32 tokens, the prompt 90)
    drafts: its state is snapshotted before its drafts. Here the target is its own draft: every draft is kept."""
    expected, _ = run(plain[name], greedy())
    itself = drafting(family_models / name, speculative="draft", draft=family_models / name, num_draft_tokens=3)
    got, fin = run(itself, greedy())
    assert got == expected and fin is not None and fin.drafted_tokens == fin.accepted_tokens > 0


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5"])
def test_a_draft_model_takes_back_rejected_drafts_out_of_layers_a_trim_cannot_undo(plain: dict, name: str) -> None:
    """A verification kept every draft, the next kept the token in hand and one draft of four: the draft model's state
    is as if it had been fed only the tokens kept, so its next proposal (drafts, and their probabilities) is a fresh
    draft model's. (The second snapshot is of a full window that a token is written into in place: a copy.)"""
    model, vocab = plain[name].model, plain[name].vocab_size
    first = ModelDrafter(model, vocab)
    drafts, _ = first.propose(PROMPT, 7, 4, None, None)
    assert drafts is not None and drafts.size == 4 and first._mark is not None  # snapshotted: a trim cannot undo
    kept = [*PROMPT, 7, *drafts.tolist()]
    first.keep(len(kept) + 1)  # all kept, and the target's token after them: 5
    drafts, _ = first.propose(kept, 5, 4, None, None)
    assert drafts is not None
    kept += [5, int(drafts[0].item())]
    first.keep(len(kept))  # the second draft rejected: the target's own token comes next
    sampling, keys = Sampling(1.0), list(mx.random.split(mx.random.key(3), 4))
    again = first.propose(kept, 11, 4, sampling, keys)
    fresh = ModelDrafter(model, vocab).propose(kept, 11, 4, sampling, keys)
    assert again[0] is not None and fresh[0] is not None and again[0].tolist() == fresh[0].tolist()
    assert mx.allclose(again[1], fresh[1], atol=1e-4).item()  # type: ignore[arg-type]


def test_a_draft_model_with_another_tokenizer_is_refused(family_models: Path, drafts: Path) -> None:
    with pytest.raises(ValueError, match="another tokenizer"):
        Engine(family_models / "llama", speculative="draft", draft=drafts / "foreign")


@pytest.mark.parametrize("name, solo", [("qwen3_5", "auto"), ("qwen3_5", "plain"), ("gemma3", "plain")],
                         ids=["recurrent-compiled", "recurrent", "full-window"])
def test_layers_a_trim_cannot_undo_draft_and_give_plain_decoding_s_ids(family_models: Path, plain: dict, name: str,
                                                                       solo: str) -> None:
    """qwen3_5's Gated DeltaNet layers (ArraysCache) and gemma3's sliding window, full from the start (its tiny
    window is 32 tokens, the prompt 90): their state is marked before a verification, given back after a rejection,
    and the kept tokens fed again. The oracle keeps every draft; a partly wrong one has drafts rejected."""
    expected, _ = run(plain[name], greedy())
    engine = Engine(family_models / name, solo=solo)
    assert (engine.graph is not None) == (solo == "auto")
    for record, all_kept in [(PROMPT + expected, True), (partly_wrong(PROMPT + expected, len(PROMPT)), False)]:
        engine.speculation = Speculation("oracle", 4, oracle=record)
        got, fin = run(engine, greedy())
        assert got == expected and fin is not None and fin.accepted_tokens > 0
        assert (fin.drafted_tokens == fin.accepted_tokens) == all_kept


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_second_request_right_after_rejected_drafts_loses_and_repeats_nothing(family_models: Path, plain: dict,
                                                                            name: str) -> None:
    """The cache the batch takes holds exactly the tokens emitted: trimmed back (llama), or given back its marked
    recurrent state and fed the kept tokens again (qwen3_5)."""
    expected, _ = run(plain[name], greedy())
    other = greedy("b", BLOCK[::-1], 10)
    expected_b, _ = run(plain[name], other)
    engine = Engine(family_models / name)
    engine.speculation = Speculation("oracle", 4, oracle=partly_wrong(PROMPT + expected, len(PROMPT)))
    engine.submit(greedy())
    got: dict[str, list[int]] = {}
    solo = engine._solo
    assert solo is not None and solo.drafting is not None
    counts = solo.drafting.counts
    while engine._solo is solo:  # until a step just rejected drafts (its cache rolled back), after some were kept
        before = counts.drafted - counts.accepted
        chunks, _ = engine.step()
        for chunk in chunks:
            got.setdefault(chunk[0], []).extend(chunk[3])
        if counts.drafted - counts.accepted > before and counts.accepted > 0:
            break
    assert engine._solo is solo and solo._next is not None  # alone still, the target's next token in hand
    engine.submit(other)
    assert engine._solo is None  # into the batch, its cache holding exactly the tokens emitted
    drive(engine, "a", got=got)
    drive(engine, "b", got=got)
    assert got["a"] == expected and got["b"] == expected_b


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_max_tokens_ends_exactly_where_plain_decoding_does(family_models: Path, plain: dict, n: int) -> None:
    engine = drafting(family_models / "llama", speculative="draft", draft=family_models / "llama")
    got, fin = run(engine, greedy(n=n))
    expected, _ = run(plain["llama"], greedy(n=n))
    assert got == expected and len(got) == n and fin is not None and fin.finish_reason == "length"


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_an_eos_among_kept_drafts_ends_it_there(family_models: Path, plain: dict, name: str) -> None:
    """A token the model says often made the EOS (in both engines): a draft step that keeps it, and drafts after
    it, must emit nothing past it, and hand back a cache of the tokens up to it (qwen3_5: re-fed, its recurrent
    state marked)."""
    expected, _ = run(plain[name], greedy())
    eos = expected[20]
    if name == "llama":
        engine = drafting(family_models / name, speculative="draft", draft=family_models / name, num_draft_tokens=8)
    else:  # a draft model of recurrent layers cannot roll back its own cache: the oracle drafts instead
        engine = Engine(family_models / name)
        engine.speculation = Speculation("oracle", 8, oracle=PROMPT + expected)
    plain[name]._eos = engine._eos = {eos}
    try:
        want, _ = run(plain[name], greedy(ignore_eos=False))
        engine.submit(greedy(ignore_eos=False))
        solo = engine._solo
        assert solo is not None
        step, said = solo.step, []
        solo.step = lambda chunk: said.append(step(chunk)) or said[-1]  # type: ignore[method-assign]
        got, fin = drive(engine, "a")
    finally:
        plain[name]._eos = set(plain[name].tokenizer.eos_token_ids)
    assert got == want == expected[:expected.index(eos)] and fin is not None and fin.finish_reason == "stop"
    assert fin.accepted_tokens > 0
    last = said[-1]  # the solo itself said nothing past the EOS, and handed back a cache of the tokens up to it
    assert len(last) > 1 and [r.finish_reason for r in last][-1] == "stop"
    assert all(r.finish_reason is None for r in last[:-1])
    attention = next(c for c in last[-1].prompt_cache if hasattr(c, "offset"))
    assert last[-1].all_tokens == PROMPT + want + [eos] and attention.offset == len(PROMPT + want) + 1


def test_a_stop_string_inside_kept_drafts_ends_it_there(family_models: Path, plain: dict) -> None:
    expected, _ = run(plain["llama"], greedy())
    stop = plain["llama"].tokenizer.decode(expected[15:18])
    want, want_fin = run(plain["llama"], greedy(stop=[stop]))
    engine = drafting(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=8)
    got, fin = run(engine, greedy(stop=[stop]))
    assert fin is not None and want_fin is not None and fin.accepted_tokens > 0
    assert (got, fin.text, fin.finish_reason) == (want, want_fin.text, want_fin.finish_reason) and len(got) < 60
    assert len(engine) == 0 and engine._solo is None


@pytest.mark.parametrize("name, mode, temperature", [("llama", "oracle", 0.8), ("qwen3_5", "prompt-lookup", 0.4)])
def test_a_seeded_sampled_request_gives_plain_seeded_ids_whole_and_resumed(family_models: Path, plain: dict,
                                                                           name: str, mode: str,
                                                                           temperature: float) -> None:
    """A seeded request's tokens are its seeded sampler's draws, each numbered by the tokens before it: drafting on
    or off, and resumed after any token (the resume's stream skips the draws of the tokens it was given), the ids
    are the same. The oracle proposes plain seeded decoding's own ids (all kept); prompt lookup keeps some."""
    def seeded(seed: int = 7, cut: int = 0) -> Submit:
        return Submit(rid="s", max_tokens=40 - cut, prompt_ids=PROMPT, temperature=temperature, seed=seed,
                      ignore_eos=True, resume_tokens=expected[:cut])

    expected: list[int] = []
    expected, _ = run(plain[name], seeded())
    if mode == "oracle":
        engine = Engine(family_models / name)
        engine.speculation = Speculation("oracle", 4, oracle=PROMPT + expected)
    else:
        engine = drafting(family_models / name, speculative=mode)
    got, fin = run(engine, seeded())
    assert got == expected and len(got) == 40 and fin is not None and fin.accepted_tokens > 0
    assert (fin.drafted_tokens == fin.accepted_tokens) == (mode == "oracle")
    for cut in (1, 13):
        engine.speculation.record = Record()  # drafting from its first token: the worker's record may start it paused
        got, fin = run(engine, seeded(cut=cut))
        assert got == expected[cut:] and fin is not None and fin.drafted_tokens > 0
    other, _ = run(engine, seeded(seed=8))
    assert other != expected  # the seed matters


def test_a_draft_that_keeps_nothing_stops_being_asked(family_models: Path, plain: dict, drafts: Path) -> None:
    expected, _ = run(plain["llama"], greedy(n=200))
    engine = drafting(family_models / "llama", speculative="draft", draft=drafts / "other")
    engine.speculation.pricing.costs = Costs(1.0, 1.8, 1.8, k=4)  # pays from ~1 draft kept per verification
    got, fin = run(engine, greedy(n=200))
    assert got == expected and fin is not None
    # verifications: MIN_VERIFIES, a pause, MIN_VERIFIES, a pause twice as long...: far fewer than 200 / 5
    assert fin.drafted_tokens <= 4 * MIN_VERIFIES * 3 and fin.accepted_tokens < fin.drafted_tokens / 4
    # the worker remembers: the next request starts where the last pause left off, so it drafts less again
    again, fin2 = run(engine, greedy(n=200))
    assert again == expected and fin2 is not None and fin2.drafted_tokens < fin.drafted_tokens


@pytest.mark.parametrize("solo", ["auto", "plain"], ids=["compiled", "uncompiled"])
def test_the_oracle_keeps_every_draft_and_gives_plain_decoding_s_ids(family_models: Path, plain: dict,
                                                                     solo: str) -> None:
    """The ceiling's hook: the target's own greedy output, recorded, proposed back. Every draft is kept, through the
    decode graph's verification (compiled: rollback moves its fill) and without it, at draft lengths 1 to 16."""
    expected, _ = run(plain["llama"], greedy())
    engine = plain["llama"] if solo == "auto" else Engine(family_models / "llama", solo=solo)
    assert (engine.graph is not None) == (solo == "auto")
    off = engine.speculation
    try:
        for k in (1, 4, 16):
            engine.speculation = Speculation("oracle", k, oracle=PROMPT + expected)
            got, fin = run(engine, greedy())
            assert got == expected and fin is not None
            # every step but the first token's drafts min(k, the tokens left): all of them kept
            assert fin.drafted_tokens == fin.accepted_tokens >= (60 - 1) * k // (k + 1) - k
    finally:
        engine.speculation = off


def test_drafting_turns_itself_off_where_verifying_costs_a_plain_step_a_token(plain: dict) -> None:
    """A machine where a verification of k + 1 tokens costs k + 1 plain steps (compute-bound): even a draft kept
    whole would not pay by the margin, so the request never drafts, and decodes as plain."""
    expected, _ = run(plain["llama"], greedy())
    engine, off = plain["llama"], plain["llama"].speculation
    try:
        engine.speculation = Speculation("prompt-lookup", 4)
        engine.speculation.pricing.costs = Costs(1.0, 2.0, 5.0, k=4)
        got, fin = run(engine, greedy())
        assert got == expected and fin is not None and fin.drafted_tokens == 0
        engine.speculation.pricing.costs = Costs(1.0, 1.2, 1.5, k=4)  # weights-bound: the same request drafts
        got, fin = run(engine, greedy())
        assert got == expected and fin is not None and fin.accepted_tokens > 0
    finally:
        engine.speculation = off


def test_the_costs_are_measured_once_per_worker(plain: dict) -> None:
    """On first use, on this machine; every later request decides with the same costs (reproducible)."""
    engine, off = plain["llama"], plain["llama"].speculation
    try:
        engine.speculation = spec = Speculation("prompt-lookup", 4)
        assert spec.pricing.costs is None
        run(engine, greedy(n=8))
        costs = spec.pricing.costs
        assert costs is not None and costs.plain_s > 0 and costs.verify_s > 0
        run(engine, greedy(n=8))
        assert spec.pricing.costs is costs
    finally:
        engine.speculation = off


def test_a_grammar_request_goes_to_the_batch_and_drafts_there_exactly(family_models: Path, plain: dict) -> None:
    """A constrained request takes logits processors, which only the batch runs: alone there, it drafts within its
    grammar (batch_drafting.py), and its ids are plain's."""
    json_only = {"type": "json", "schema": None}
    expected, _ = run(plain["llama"], greedy(n=30, constraint=json_only))
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    engine.submit(greedy(n=30, constraint=json_only))
    assert engine._solo is None  # in the batch
    got, fin = drive(engine, "a")
    assert got == expected and fin is not None and fin.drafted_tokens > 0


def test_a_resumed_request_drafts_and_continues_plain_decoding_exactly(family_models: Path, plain: dict) -> None:
    """A greedy resume with nothing only the batch has runs alone, drafting: its ids are the rest of plain's."""
    expected, _ = run(plain["llama"], greedy())
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    for cut in (1, 23):
        got, fin = run(engine, greedy(n=60 - cut, resume_tokens=expected[:cut]))
        assert got == expected[cut:] and fin is not None and fin.accepted_tokens > 0


def test_a_drafter_with_nothing_to_propose_is_asked_less_and_less(family_models: Path, plain: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for drafts reads the token in hand before the next one is launched (a stall of plain decoding's
    pipelining): prompt lookup finding no match was asked at every step, alone and in the batch. After nothing, it
    is asked again a doubling number of tokens later (up to speculative.MAX_IDLE); the ids stay plain decoding's."""
    asked: list[int] = []

    def nothing(self: object, tokens: list[int], *args: object) -> tuple[None, None]:
        asked.append(len(tokens))
        return None, None

    monkeypatch.setattr(PromptLookup, "propose", nothing)
    expected, _ = run(plain["llama"], greedy(n=100))
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    engine.batch_drafts.costs = FREE
    got, fin = run(engine, greedy(n=100))
    assert got == expected and fin is not None and fin.drafted_tokens == 0
    assert 4 <= len(asked) <= 10  # after tokens 1, 2, 4, 8, 16, then every 16: not 100 times
    asked.clear()
    engine.submit(greedy("b", n=100))
    engine.submit(greedy("c", n=100))
    drive(engine, "b")
    assert 4 <= len(asked) <= 2 * 10  # both rows asked at each of the batch's drafting steps


def test_a_worker_prices_drafting_in_its_idle_work_and_no_request_waits_for_it(family_models: Path,
                                                                               plain: dict) -> None:
    """With idle pricing (the worker's), a request before the costs are known decodes plainly and measures nothing;
    the idle work (`warm_step`) measures them a forward pass at a time, not while a request is in flight, the
    solo's and the batch's at each size, and then has nothing left to do."""
    expected, _ = run(plain["llama"], greedy())
    engine = Engine(family_models / "llama", speculative="prompt-lookup", idle_pricing=True, max_batch_size=2)
    pricing = engine.speculation.pricing
    got, fin = run(engine, greedy())
    assert got == expected and fin is not None and fin.drafted_tokens == 0 and pricing.costs is None
    engine.submit(greedy("busy", n=4))
    assert engine.warm_step() and pricing.costs is None  # busy: nothing measured
    drive(engine, "busy")
    steps = 0
    while engine.warm_step():
        steps += 1
        assert steps < 500
    assert engine.priced and pricing.at(2).costs is not None and steps > 10
    assert pricing._sizes.keys() == {1, 2}  # the batch sizes up to max_batch_size only
    got, _ = run(engine, greedy())
    assert got == expected


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_drafting_beside_graphs_built_ahead_gives_plain_decoding_s_ids(family_models: Path, plain: dict,
                                                                      name: str) -> None:
    """The solo's `ahead` mode (MLX CUDA's default) builds a plain step's graph ahead whenever the next step will
    not draft (paused, or its drafter idle), and a step never drafts over a graph built ahead: the ids are plain's."""
    expected, _ = run(plain[name], greedy())
    engine = drafting(family_models / name, speculative="prompt-lookup", solo="ahead")
    got, fin = run(engine, greedy())
    assert got == expected and fin is not None and fin.accepted_tokens > 0


def test_prompt_lookup_s_drafting_depends_on_its_own_request_only(family_models: Path, plain: dict) -> None:
    """A draft model's pauses carry over to the worker's next request (its Record: random weights keep nothing,
    whatever the prompt); prompt lookup's do not: a code edit after a chat finds its drafts in its own prompt, so a
    request drafts exactly as it would as the worker's first, whatever came before."""
    costs = Costs(1.0, 1.2, 1.5, k=4)
    fresh = drafting(family_models / "llama", speculative="prompt-lookup")
    fresh.speculation.pricing.costs = costs
    _, first = run(fresh, greedy("b"))
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    engine.speculation.pricing.costs = costs
    engine.speculation.record.wait = engine.speculation.record.pause = 1024  # as after a chat's rejected drafts
    _, after = run(engine, greedy("b"))
    assert first is not None and after is not None and first.accepted_tokens > 0
    assert (after.drafted_tokens, after.accepted_tokens) == (first.drafted_tokens, first.accepted_tokens)
