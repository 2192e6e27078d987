"""Drafting in the solo gives plain decoding's tokens, exactly (issue 30, first slice).

Real MLX on the CPU, the families' tiny models, the product's Engine driven by submit/step. Greedy ids with
drafting on (prompt lookup, a draft model) must be those with it off, token for token: where drafts are kept
(KV caches: llama, qwen3), where the caches allow drafting only for a while (gemma3: its sliding window fills)
and where they never do (qwen3_5: recurrent layers); across a hand-over into the batch right after a step that
kept drafts; ending exactly at max_tokens, an EOS and a stop string. A seeded sampled request is reproducible,
and a draft that keeps nothing stops being asked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from protocol.messages import Finished, Submit
from worker.mlx_engine.draft_pricing import Costs
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.speculative import MIN_VERIFIES, Speculation

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


@pytest.mark.parametrize("name", ["llama", "qwen3"])
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


def test_a_draft_model_with_another_tokenizer_is_refused(family_models: Path, drafts: Path) -> None:
    with pytest.raises(ValueError, match="another tokenizer"):
        Engine(family_models / "llama", speculative="draft", draft=drafts / "foreign")


def test_a_sliding_window_drafts_until_it_is_full_then_decodes_plainly(family_models: Path, plain: dict) -> None:
    """gemma3's tiny window is 32 tokens: a 12-token prompt drafts, and past the window a trim could not undo a
    draft (the window overwrote what it would need), so drafting ends for the request."""
    prompt = BLOCK[:6] * 2
    expected, _ = run(plain["gemma3"], greedy(prompt=prompt, n=40))
    engine = drafting(family_models / "gemma3", speculative="prompt-lookup")
    got, fin = run(engine, greedy(prompt=prompt, n=12), until=8)
    assert engine._solo is not None and engine._solo.drafting is not None
    drive(engine, "a")
    got, fin = run(engine, greedy(prompt=prompt, n=40), until=30)
    assert engine._solo is not None and engine._solo.drafting is None  # the window is full: off
    more, fin = drive(engine, "a")
    assert got + more == expected and fin is not None and fin.drafted_tokens > 0


def test_recurrent_layers_never_draft(family_models: Path, plain: dict) -> None:
    expected, _ = run(plain["qwen3_5"], greedy())
    engine = drafting(family_models / "qwen3_5", speculative="prompt-lookup")
    got, fin = run(engine, greedy(), until=2)
    assert engine._solo is not None and engine._solo.drafting is None  # no rollback for an ArraysCache
    more, fin = drive(engine, "a")
    assert got + more == expected and fin is not None and fin.drafted_tokens == 0


def test_a_second_request_right_after_rejected_drafts_loses_and_repeats_nothing(family_models: Path,
                                                                            plain: dict) -> None:
    expected, _ = run(plain["llama"], greedy())
    other = greedy("b", BLOCK[::-1], 10)
    expected_b, _ = run(plain["llama"], other)
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    engine.submit(greedy())
    got: dict[str, list[int]] = {}
    solo = engine._solo
    assert solo is not None and solo.drafting is not None
    counts = solo.drafting.counts
    while True:  # until a step just rejected drafts (its cache trimmed back), after some were kept
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


def test_an_eos_among_kept_drafts_ends_it_there(family_models: Path, plain: dict) -> None:
    """A token the model says often made the EOS (in both engines): a draft step that keeps it, and drafts after
    it, must emit nothing past it."""
    expected, _ = run(plain["llama"], greedy())
    eos = expected[20]
    engine = drafting(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=8)
    plain["llama"]._eos = engine._eos = {eos}
    try:
        want, _ = run(plain["llama"], greedy(ignore_eos=False))
        engine.submit(greedy(ignore_eos=False))
        solo = engine._solo
        assert solo is not None
        step, said = solo.step, []
        solo.step = lambda chunk: said.append(step(chunk)) or said[-1]  # type: ignore[method-assign]
        got, fin = drive(engine, "a")
    finally:
        plain["llama"]._eos = set(plain["llama"].tokenizer.eos_token_ids)
    assert got == want == expected[:expected.index(eos)] and fin is not None and fin.finish_reason == "stop"
    assert fin.accepted_tokens > 0
    last = said[-1]  # the solo itself said nothing past the EOS, and handed back a cache of the tokens up to it
    assert [r.finish_reason for r in last][-1] == "stop" and all(r.finish_reason is None for r in last[:-1])
    assert last[-1].all_tokens == PROMPT + want + [eos] and last[-1].prompt_cache[0].offset == len(PROMPT + want) + 1


def test_a_stop_string_inside_kept_drafts_ends_it_there(family_models: Path, plain: dict) -> None:
    expected, _ = run(plain["llama"], greedy())
    stop = plain["llama"].tokenizer.decode(expected[15:18])
    want, want_fin = run(plain["llama"], greedy(stop=[stop]))
    engine = drafting(family_models / "llama", speculative="draft", draft=family_models / "llama", num_draft_tokens=8)
    got, fin = run(engine, greedy(stop=[stop]))
    assert fin is not None and want_fin is not None and fin.accepted_tokens > 0
    assert (got, fin.text, fin.finish_reason) == (want, want_fin.text, want_fin.finish_reason) and len(got) < 60
    assert len(engine) == 0 and engine._solo is None


def test_a_seeded_sampled_request_is_reproducible(family_models: Path) -> None:
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    msg = Submit(rid="s", max_tokens=40, prompt_ids=PROMPT, temperature=0.8, seed=7, ignore_eos=True)
    first, fin = run(engine, msg)
    again, fin2 = run(engine, msg)
    assert first == again and len(first) == 40
    assert fin is not None and fin2 is not None and fin.drafted_tokens == fin2.drafted_tokens > 0
    other, _ = run(engine, Submit(rid="t", max_tokens=40, prompt_ids=PROMPT, temperature=0.8, seed=8, ignore_eos=True))
    assert other != first  # the seed matters


def test_a_draft_that_keeps_nothing_stops_being_asked(family_models: Path, plain: dict, drafts: Path) -> None:
    expected, _ = run(plain["llama"], greedy(n=200))
    engine = drafting(family_models / "llama", speculative="draft", draft=drafts / "other")
    engine.speculation.pricing.costs = Costs(1.0, 1.8, 1.8, k=4)  # pays from ~1 draft kept per verification
    got, fin = run(engine, greedy(n=200))
    assert got == expected and fin is not None
    # verifications: MIN_VERIFIES, a pause, MIN_VERIFIES, a pause twice as long...: far fewer than 200 / 5
    assert fin.drafted_tokens <= 4 * MIN_VERIFIES * 3 and fin.accepted_tokens < fin.drafted_tokens / 4


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


def test_a_grammar_request_goes_to_the_batch_undrafted_and_exact(family_models: Path, plain: dict) -> None:
    """A constrained request takes logits processors, which only the batch runs: no drafting, plain's ids."""
    json_only = {"type": "json", "schema": None}
    expected, _ = run(plain["llama"], greedy(n=30, constraint=json_only))
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    engine.submit(greedy(n=30, constraint=json_only))
    assert engine._solo is None  # in the batch
    got, fin = drive(engine, "a")
    assert got == expected and fin is not None and fin.drafted_tokens == 0


def test_a_resumed_request_drafts_and_continues_plain_decoding_exactly(family_models: Path, plain: dict) -> None:
    """A greedy resume with nothing only the batch has runs alone, drafting: its ids are the rest of plain's."""
    expected, _ = run(plain["llama"], greedy())
    engine = drafting(family_models / "llama", speculative="prompt-lookup")
    for cut in (1, 23):
        got, fin = run(engine, greedy(n=60 - cut, resume_tokens=expected[:cut]))
        assert got == expected[cut:] and fin is not None and fin.accepted_tokens > 0
