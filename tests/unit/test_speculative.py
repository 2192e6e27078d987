"""Speculative decoding's pure parts (issue 30): prompt lookup, the accept/reject rule's distribution, when drafting
pauses, and the config keys that turn it on. Real MLX on the CPU for the rule; no model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from protocol.messages import Submit
from supervisor.draft_config import speculative_args
from supervisor.process import model_args
from worker.__main__ import parse_args
from worker.mlx_engine.draft_pricing import REPEATS, WARMUPS, Costs, Pricing, fastest
from worker.mlx_engine.guided import seeded_sampler
from worker.mlx_engine.speculative import (
    DEFAULT_DRAFT_TOKENS,
    FIRST_PAUSE,
    MIN_VERIFIES,
    Drafting,
    Oracle,
    PromptLookup,
    Sampling,
    Speculation,
    accept_sampled,
    default_mode,
    leading,
    lookup,
)


def h(*ids: int) -> np.ndarray:
    return np.array(ids, np.int64)


@pytest.mark.parametrize("history, k, expected", [
    ((1, 2, 3, 4, 5, 9, 1, 2, 3), 2, [4, 5]),  # the 3-gram 1 2 3 recurs: what followed it
    ((1, 2, 3, 4, 5, 6, 7, 2, 3), 4, [4, 5, 6, 7]),  # no 3-gram; the 2-gram 2 3
    ((7, 1, 8, 6, 1, 9, 1), 3, [9, 1, 9]),  # a 1-gram: its latest earlier occurrence (1 at 4), then 9 1 again
    ((1, 2, 3, 1, 2, 3, 1, 2, 3), 3, [1, 2, 3]),  # the latest of several: the one ending right before the suffix
    ((1, 2, 3, 1, 2, 3, 1, 2), 5, [3, 1, 2, 3, 1]),  # what follows runs into the end: the period goes on
    ((1, 2, 3, 4), 3, []),  # nothing recurs
    ((5,), 3, []),
    ((5, 5), 3, [5, 5, 5]),
])
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match(history: tuple, k: int,
                                                                       expected: list[int]) -> None:
    assert lookup(h(*history), k) == expected


def test_prompt_lookup_drafts_k_tokens_a_step_on_a_repeated_token() -> None:
    """A model looping on one token (")" over and over): its latest earlier occurrence is the token before it, with
    one token after it; drafting only that gave 1 draft a step where k were all kept (an H100 run: 127 of 256)."""
    drafter = PromptLookup()
    tokens = [3, 8, 5, 12, 7]
    for step in range(6):
        drafts, _ = drafter.propose(tokens, 7, 4, None, None)
        assert drafts is not None and drafts.tolist() == [7, 7, 7, 7], step
        tokens += [7] * 5  # the token in hand and the 4 drafts, all kept


def test_prompt_lookup_mirrors_a_growing_history() -> None:
    drafter = PromptLookup()
    tokens = list(range(10, 300)) + [10, 11]
    drafts, q = drafter.propose(tokens, 12, 3, None, None)
    assert q is None and drafts is not None and drafts.tolist() == [13, 14, 15]
    drafts, _ = drafter.propose([*tokens, 12, 13], 999, 3, None, None)  # the history grew by what was kept
    assert drafts is None  # 999 never occurred: no draft
    assert drafter.propose([*tokens, 12, 13, 999], 10, 2, None, None)[0].tolist() == [11, 12]  # the latest 10, 11, 12


def test_leading_counts_until_the_first_refusal() -> None:
    assert leading([True, True, False, True]) == 2 and leading([]) == 0 and leading([False]) == 0
    assert leading([True, True]) == 2


P = mx.array([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])  # a target distribution over six tokens (token 5 impossible)
N = 20000  # independent trials, one per row: each row's first emitted token must be distributed as P


def first_tokens(drafts: mx.array, q: mx.array | None) -> np.ndarray:
    p = mx.broadcast_to(P, (N + 1, P.size))
    kept, after = accept_sampled(p, drafts, q, mx.random.key(3))
    return np.where(np.array(kept), np.array(drafts), np.array(after[:N]))


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=P.size) / len(tokens)


@pytest.mark.parametrize("draft", [1, 0, 5], ids=["likely", "unlikely", "impossible"])
def test_a_deterministic_draft_keeps_the_target_distribution(draft: int) -> None:
    """Prompt lookup's rule: keep d with probability p(d), else draw from p without d. Drawing from p itself
    on a rejection (forgetting to remove d) gives d too much mass, and this fails."""
    got = frequencies(first_tokens(mx.full((N,), draft, mx.uint32), None))
    assert np.abs(got - np.array(P)).max() < 0.02, got


def test_a_sampled_draft_keeps_the_target_distribution() -> None:
    """The general rule for a draft model's q: keep d with probability min(1, p(d)/q(d)), else draw from
    max(p - q, 0). Accepting every draft would give q (far from p), and this fails."""
    q0 = mx.array([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    drafts = mx.random.categorical(mx.log(q0), num_samples=N, key=mx.random.key(5)).astype(mx.uint32)
    got = frequencies(first_tokens(drafts, mx.broadcast_to(q0, (N, P.size))))
    assert np.abs(got - np.array(P)).max() < 0.02, got


def test_the_bonus_token_is_drawn_from_the_last_position() -> None:
    p = mx.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # the draft (1) is certain, the next position says 2
    kept, after = accept_sampled(p, mx.array([1], mx.uint32), None, None)
    assert kept.tolist() == [True] and after.tolist()[1] == 2


def test_sampling_applies_the_request_s_filters() -> None:
    logprobs = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.allclose(np.array(Sampling(1.0).probs(logprobs)), [[0.5, 0.3, 0.15, 0.05]], atol=1e-6)
    top2 = np.array(Sampling(1.0, top_k=2).probs(logprobs))[0]
    assert np.allclose(top2, [0.625, 0.375, 0, 0], atol=1e-6)
    cold = np.array(Sampling(0.5).probs(logprobs))[0]
    assert cold[0] > 0.6 and np.isclose(cold.sum(), 1.0)


def priced(costs: Costs, k: int = 4) -> Drafting:
    d = Drafting(PromptLookup(), k, None, None, Pricing(k, None, costs))
    d.priced(None, None, 0)  # type: ignore[arg-type]  # the costs are given: no model is measured
    return d


def test_break_even_is_where_a_verification_s_tokens_pay_for_it() -> None:
    """A verification of k drafts emits the kept ones and one of its own: it pays when (1 + kept) plain steps
    cost more than it does, by the margin."""
    weights_bound = Costs(1.0, 1.1, 1.3, k=4)  # a GPU at one stream: k + 1 tokens cost little more than one
    assert weights_bound.break_even(4) == pytest.approx(1.1 * 1.3 - 1)
    assert weights_bound.verify(3) == pytest.approx(1.1 + 0.2 * 1 / 3) and weights_bound.verify(1) == 1.0
    compute_bound = Costs(1.0, 2.0, 5.0, k=4)  # this CPU: k + 1 tokens cost k + 1 steps
    assert compute_bound.break_even(4) == pytest.approx(1.1 * 5 - 1) and compute_bound.break_even(4) > 4  # even all 4 kept: no
    with_a_draft_model = Costs(1.0, 1.1, 1.3, k=4, draft_s=0.25)  # its 4 steps count too
    assert with_a_draft_model.break_even(4) == pytest.approx(1.1 * 2.3 - 1)
    # a rejection undone by feeding the 2 kept tokens again (recurrent layers): that forward pass counts
    assert weights_bound.break_even(4, refeed=2) == pytest.approx(1.1 * (1.3 + 1.1) - 1)


class FakeForward:
    """A forward pass of n tokens on a fake clock: `cost[n]` seconds, three times that during the calls in `slow`
    (a stretch when the machine was busy)."""

    def __init__(self, cost: dict[int, float], slow: range) -> None:
        self.cost, self.slow = cost, slow
        self.now = 0.0
        self.calls = 0

    def run(self, n: int) -> Callable[[], None]:
        def forward() -> None:
            self.now += self.cost[n] * (3 if self.calls in self.slow else 1)
            self.calls += 1
        return forward


@pytest.mark.parametrize("slow", [range(9), range(4, 13), range(9, 18), range(12, 21)])
def test_pricing_times_each_shape_around_a_slow_stretch(slow: range) -> None:
    """A stretch of 9 slow calls (of 21) must not price any shape: timed one shape after the other (a warm-up,
    then its 5 runs), each of these stretches covered one shape's whole series and set its cost 3x."""
    true = {1: 1.0, 2: 1.1, 5: 1.3}
    fake = FakeForward(true, slow)
    seconds = fastest({str(n): fake.run(n) for n in true}, clock=lambda: fake.now)
    assert seconds == {str(n): pytest.approx(c) for n, c in true.items()}
    costs = Costs.measured({int(n): s for n, s in seconds.items()}, k=4)
    assert costs.break_even(4) == pytest.approx(1.1 * 1.3 - 1)


def test_a_cost_above_a_longer_pass_s_is_that_one_s() -> None:
    costs = Costs.measured({1: 1.0, 2: 2.5, 5: 1.3}, k=4)  # 2 tokens cannot cost more than 5
    assert (costs.plain_s, costs.verify2_s, costs.verify_s) == (1.0, 1.3, 1.3)
    assert Costs.measured({1: 1.4, 2: 1.2}, k=1).plain_s == 1.2  # k = 1: the verification is of 2 tokens
    assert Costs.measured({1: 1.0, 2: 1.2}, k=1).break_even(1) == pytest.approx(1.1 * 1.2 - 1)


def test_drafting_never_starts_where_even_a_whole_draft_would_not_pay() -> None:
    d = priced(Costs(1.0, 2.0, 5.0, k=4))
    assert not d.wants(0) and not d.wants(10**9)
    assert priced(Costs(1.0, 1.1, 1.3, k=4)).wants(0)


def test_drafting_pauses_below_break_even_and_doubles_the_pause() -> None:
    d = priced(Costs(1.0, 1.8, 1.8, k=4))  # pays from ~1 kept per verification
    for i in range(MIN_VERIFIES):
        assert d.wants(i)
        d.observe(4, 0, generated=i)
    assert not d.wants(MIN_VERIFIES) and d.wants(MIN_VERIFIES - 1 + FIRST_PAUSE)
    assert d.counts.drafted == 4 * MIN_VERIFIES and d.counts.accepted == 0
    start = MIN_VERIFIES - 1 + FIRST_PAUSE
    for i in range(MIN_VERIFIES):
        d.observe(4, 0, generated=start + i)
    assert d.resume_at == start + MIN_VERIFIES - 1 + 2 * FIRST_PAUSE  # the second pause is twice the first

    good = priced(Costs(1.0, 1.8, 1.8, k=4))
    for i in range(50):
        good.observe(4, 2, generated=i)  # 2 kept: above break-even (0.98), though not every draft
    assert good.wants(50) and good.counts.accepted == 100
    costly = priced(Costs(1.0, 2.5, 3.0, k=4))  # break-even 2.3: the same 2 kept do not pay here
    for i in range(20):
        if costly.wants(i):
            costly.observe(4, 2, generated=i)
    assert costly.resume_at > 0 and costly.counts.drafted < 4 * 20  # paused


def test_a_re_feed_after_each_rejection_makes_drafting_pause_where_a_trim_would_pay() -> None:
    """One kept of 4 pays where a trim undoes the rest (break-even 0.43), not where the kept token (and the one in
    hand) are fed again in a forward pass of their own (break-even 1.64): there drafting pauses."""
    trimmed, refed = priced(Costs(1.0, 1.1, 1.3, k=4)), priced(Costs(1.0, 1.1, 1.3, k=4))
    for i in range(2 * MIN_VERIFIES):
        trimmed.observe(4, 1, generated=i)
        refed.observe(4, 1, generated=i, refed=2)
    assert trimmed.wants(2 * MIN_VERIFIES) and not refed.wants(2 * MIN_VERIFIES)


def test_the_oracle_proposes_the_record_while_the_history_follows_it() -> None:
    oracle = Oracle([5, 6, 7, 8, 9, 10])

    def drafts(tokens: list[int], y: int, k: int) -> list[int] | None:
        proposed = oracle.propose(tokens, y, k, None, None)[0]
        return None if proposed is None else proposed.tolist()  # type: ignore[return-value]

    assert drafts([5, 6], 7, 2) == [8, 9]
    assert drafts([5, 6], 7, 9) == [8, 9, 10]  # as far as the record goes
    assert drafts([5, 6], 3, 2) is None  # off the record: no draft
    assert drafts([5, 6, 7, 8, 9], 10, 2) is None  # the record's end
    spec = Speculation("oracle", 3, oracle=[5, 6, 7])
    d = spec.drafting(Submit(rid="o", max_tokens=4, prompt_ids=[5], temperature=0.0))
    assert d is not None and isinstance(d.drafter, Oracle) and d.pricing is None  # it always drafts
    assert d.priced(None, None, 0) and d.break_even == -1.0  # type: ignore[arg-type]
    for i in range(3 * MIN_VERIFIES):
        d.observe(3, 0, generated=i)
    assert d.wants(3 * MIN_VERIFIES)
    with pytest.raises(ValueError, match="oracle"):
        Speculation("oracle", 3)


def test_a_seeded_request_s_draws_are_its_seeded_sampler_s() -> None:
    """The solo samples a seeded request that drafts with its `Draws`, and verification draws from it by position:
    token for token what the request's seeded sampler (guided.py, the batch's) draws, a resume's skip included, so
    a hand-over or a resume continues the same stream."""
    spec = Speculation("prompt-lookup", 4, vocab=1024)
    msg = Submit(rid="a", max_tokens=4, prompt_ids=[1], temperature=0.7, seed=11, top_k=50, resume_tokens=[3, 4, 5])
    d = spec.drafting(msg)
    assert d is not None and d.draws is not None and d.sampling == Sampling(0.7, top_k=50)
    sampler = seeded_sampler(0.7, 1.0, 0.0, 50, 11, skip=3)
    logprobs = [mx.log(mx.softmax(mx.random.normal((1, 1024), key=mx.random.key(i)))) for i in range(12)]
    ahead = d.draws.keys(4)  # the next 4 draws' keys, not used up
    by_key = [d.draws.sample(lp, key).item() for lp, key in zip(logprobs[:4], ahead)]
    d.draws.advance(4)
    drawn = by_key + [d.draws(lp).item() for lp in logprobs[4:]]
    assert drawn == [sampler(lp).item() for lp in logprobs]
    assert len(set(drawn)) > 1  # not one token over and over: the draws differ
    greedy = spec.drafting(Submit(rid="g", max_tokens=4, prompt_ids=[1], temperature=0.0, seed=11))
    assert greedy is not None and greedy.sampling is None and greedy.draws is None
    assert Speculation().drafting(msg) is None  # off
    with pytest.raises(ValueError, match="needs a draft model"):
        Speculation("draft")


def model_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 100)
    return path


def test_config_keys_become_worker_arguments(tmp_path: Path) -> None:
    draft = model_folder(tmp_path / "small")
    assert speculative_args({}, "models.m", tmp_path) == ((), 0)
    assert speculative_args({"speculative": "prompt-lookup", "num_draft_tokens": 6}, "models.m", tmp_path) == (
        ("--speculative", "prompt-lookup", "--num-draft-tokens", "6"), 0)
    args, weights = speculative_args({"draft": "small"}, "models.m", tmp_path)  # draft: relative to the config
    assert args == ("--speculative", "draft", "--draft", str(draft)) and weights == 100
    for entry, match in [({"speculative": "fast"}, "speculative"), ({"speculative": "draft"}, "goes with"),
                         ({"draft": "nowhere"}, "holds no config.json"), ({"num_draft_tokens": 0}, "num_draft_tokens"),
                         ({"speculative": "prompt-lookup", "draft": "small"}, "goes with")]:
        with pytest.raises(ValueError, match=match):
            speculative_args(entry, "models.m", tmp_path)
    parsed = parse_args(["--endpoint", "e", "--identity", "i", "--model-path", "m", "--model-id", "m", *args])
    # no --num-draft-tokens: the kind's own default (4; a DFlash drafter's block size - 1)
    assert parsed.speculative == "draft" and parsed.draft == draft and parsed.num_draft_tokens is None
    assert Speculation("prompt-lookup").k == DEFAULT_DRAFT_TOKENS == 4
    plain = parse_args(["--endpoint", "e", "--identity", "i", "--model-path", "m", "--model-id", "m"])
    assert plain.speculative == "auto" and plain.draft is None


def test_auto_drafts_with_prompt_lookup_on_a_gpu_and_not_on_a_cpu() -> None:
    assert default_mode(draft=False, gpu=True) == "prompt-lookup"
    assert default_mode(draft=False, gpu=False) == "off"
    assert default_mode(draft=True, gpu=False) == default_mode(draft=True, gpu=True) == "draft"
    assert Speculation("auto").mode == default_mode(False, mx.default_device() == mx.gpu)


def test_the_server_s_mode_is_every_model_s_unless_its_own_says() -> None:
    """`[server] speculative` (serve --speculative) goes on every worker's command line, before the model's own
    arguments, which win; "auto", the worker's default, adds nothing."""
    base = ["--endpoint", "e", "--identity", "i"]
    assert "--speculative" not in model_args(Path("m"), "m", 8, 512)
    args = model_args(Path("m"), "m", 8, 512, speculative="off")
    assert parse_args([*base, *args]).speculative == "off"
    own = model_args(Path("m"), "m", 8, 512, ("--speculative", "prompt-lookup"), speculative="off")
    assert parse_args([*base, *own]).speculative == "prompt-lookup"


def test_the_draft_length_follows_the_acceptance_seen() -> None:
    """Where a verification costs more with each draft, the length that emits the most tokens a second grows with
    the acceptance: 1 where drafts are mostly rejected, the most allowed where they are kept whole; free drafts
    (a verification of any length a plain step's cost) and the oracle (no costs) always draft the most."""
    d = priced(Costs(1.0, 1.2, 3.0, k=8), k=8)
    assert d.length(8) in range(1, 9)
    for _ in range(8):
        d.observe(8, 0, 0)
    low = d.length(8)
    for _ in range(20):
        d.observe(8, 8, 0)
    assert low == 1 and d.length(8) == 8 and d.length(3) == 3
    free = priced(Costs(1.0, 1.0, 1.0, k=8), k=8)
    free.observe(8, 1, 0)
    assert free.length(8) == 8
    assert Drafting(PromptLookup(), 8, None, None, None).length(8) == 8


def test_idle_pricing_measures_a_forward_pass_per_step_and_no_request_waits() -> None:
    """An idle Pricing is never measured by a request (`get` says "not yet"), only by its steps: the solo's
    costs, then a batch's at each size asked, each its own Pricing; then it has nothing left to do."""
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=64))
    pricing = Pricing(2, None, idle=True)
    d = Drafting(PromptLookup(), 2, None, None, pricing)
    assert pricing.get(model, None) is None and not d.priced(model, None, 0) and d.break_even is None
    steps = 0
    while pricing.step(model, None, (2,)):
        steps += 1
        assert steps < 200
    assert pricing.costs is not None and pricing.at(2).costs is not None and pricing.at(2).rows == 2
    assert steps > 2 * (WARMUPS + REPEATS)  # a forward pass per step, not a measurement
    d.priced(model, None, 0)  # (whether drafting pays on this CPU is not this test's concern)
    assert d.costs is pricing.costs and d.break_even is not None
    assert not pricing.step(model, None, (2,))


def test_usage_reports_drafted_and_accepted_tokens() -> None:
    from protocol.messages import Finished
    from supervisor.gateway.openai_shape import usage

    plain = Finished(rid="a", text="", finish_reason="stop", prompt_tokens=3, completion_tokens=9)
    assert "completion_tokens_details" not in usage([plain])
    drafted = Finished(rid="a", text="", finish_reason="stop", prompt_tokens=3, completion_tokens=9,
                       drafted_tokens=8, accepted_tokens=5)
    assert usage([drafted])["completion_tokens_details"] == {"accepted_prediction_tokens": 5,
                                                             "rejected_prediction_tokens": 3}


def test_serve_s_flag_and_the_server_key_set_every_model_s_mode(tmp_path: Path) -> None:
    """`mlxsup serve --speculative MODE` and `[server] speculative`: auto, off or prompt-lookup ("draft" needs a
    model's own draft: a config error, as is a mode that does not exist); the default is auto."""
    from supervisor.cli.commands import build_parser
    from supervisor.config import ConfigError, Settings, load_file

    assert build_parser().parse_args(["serve", "--speculative", "off"]).speculative == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative", "draft"])
    assert Settings().speculative == "auto"
    path = tmp_path / "c.toml"
    path.write_text('[server]\nspeculative = "prompt-lookup"\n')
    assert load_file(path, Settings()).speculative == "prompt-lookup"
    for bad in ("draft", "fast"):
        path.write_text(f'[server]\nspeculative = "{bad}"\n')
        with pytest.raises(ConfigError, match="server.speculative"):
            load_file(path, Settings())
