"""A checkpoint's MTP head drafts, and plain decoding's tokens come out (issue 52).

Real MLX on the CPU: a tiny Qwen3.5 with random MTP weights of the layout its checkpoints ship (`make-model --mtp`),
the product's Engine driven by submit/step. Random weights keep few drafts, so the head's bookkeeping is checked
directly: every proposal must be what the head computes from the target's own hidden states over the whole history
(recomputed here from scratch, no cache), when its drafts are rejected and when they are all kept (a record proposed
in their place: the forced-acceptance hook), compiled and not. Then the ids: greedy and seeded, alone, after a
hand-over into the batch, after a prefix-cache hit, with the running cache quantized, resumed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from protocol.messages import Submit
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.mtp import MTPDrafter, MTPHead, load_head
from worker.mlx_engine.prompt_cache import CacheOptions
from worker.mlx_engine.speculative import Speculation, default_mode
from worker.mlx_engine.taps import tap_of, text_model

from .test_speculative import PROMPT, drive, greedy, run


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model import make_model
    from worker.mlx_engine.make_model.weights import write_mtp_head

    path = tmp_path_factory.mktemp("mtp") / "qwen3_5"
    make_model(path, "tiny", seed=0, arch="qwen3_5")
    write_mtp_head(path, seed=0)
    return path


@pytest.fixture(scope="module")
def plain(mtp_model: Path) -> Engine:
    return Engine(mtp_model, speculative="off")


def always(engine: Engine) -> Engine:
    """Draft at every step at the full length: the tests' concern is what drafting gives, not whether it pays."""
    engine.speculation.pricing = None  # type: ignore[assignment]
    return engine


def spying(drafter: type) -> type:
    """`drafter` keeping each proposal with the history it was made after, in the class's `calls` (a tapped drafter:
    tests/families/test_dflash.py's too)."""
    def propose(self, tokens, y, k, sampling, keys):  # type: ignore[no-untyped-def]
        drafts, q = drafter.propose(self, tokens, y, k, sampling, keys)
        if drafts is not None:
            type(self).calls.append(([*tokens, y], [int(t) for t in drafts.tolist()]))
        return drafts, q
    return type(f"Spy{drafter.__name__}", (drafter,), {"calls": [], "propose": propose})


Spy = spying(MTPDrafter)


def reference(engine: Engine, head: MTPHead, history: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `history`, from scratch: the target's hidden states over all but its last
    token, paired with the token after each."""
    inner = text_model(engine.model)
    assert inner is not None
    hidden = inner(mx.array(history[:-1])[None])  # the final norm's output: what the tap hands on
    cache = head.make_cache()
    out = head(mx.array(history[1:])[None], hidden, cache)[:, -1:]
    drafts = []
    for _ in range(k):
        d = mx.argmax(head.logits(out)[0], axis=-1)
        drafts.append(int(d.item()))
        out = head(d[None], out, cache)
    return drafts


def test_make_model_writes_a_head_mlx_lm_drops_and_the_worker_loads_as_written(mtp_model: Path) -> None:
    model, _ = load(str(mtp_model))
    assert not any("mtp" in name for name in dict(tree_flatten(model.parameters())))
    head = load_head(model, mtp_model)
    assert head is not None
    written = mx.load(str(mtp_model / "model-mtp.safetensors"))
    got = dict(tree_flatten(head.parameters()))
    assert set(written) == {f"mtp.{k}" for k in got}
    assert all(mx.array_equal(written[f"mtp.{k}"], v).item() for k, v in got.items())


def test_a_hugging_face_checkpoint_s_head_norms_are_shifted_as_mlx_lm_shifts_the_model_s(
        mtp_model: Path, tmp_path: Path) -> None:
    """Where the checkpoint's conv1d weights are unconverted (an original Hugging Face checkpoint), mlx-lm adds one
    to its zero-centred norms; the head's norms get the same."""
    hf = tmp_path / "hf"
    shutil.copytree(mtp_model, hf)
    weights = mx.load(str(hf / "model-mtp.safetensors"))
    mx.save_safetensors(str(hf / "model-mtp.safetensors"), {**weights, "x.conv1d.weight": mx.zeros((4, 1, 3))})
    model, _ = load(str(mtp_model))
    head = load_head(model, hf)
    assert head is not None
    assert mx.allclose(head.norm.weight, weights["mtp.norm.weight"] + 1).item()
    assert mx.allclose(head.layers[0].input_layernorm.weight, weights["mtp.layers.0.input_layernorm.weight"] + 1).item()
    assert mx.array_equal(head.fc.weight, weights["mtp.fc.weight"]).item()


def test_auto_drafts_with_the_head_on_a_gpu_and_nothing_on_a_cpu(mtp_model: Path, family_models: Path) -> None:
    assert default_mode(False, True, True) == "mtp" and default_mode(False, True, False) == "prompt-lookup"
    assert default_mode(False, False, True) == "off" and default_mode(True, True, True) == "draft"
    cpu = Engine(mtp_model)
    assert cpu.speculation.mode == "off" and tap_of(cpu.model) is None  # this CPU: the head not even read
    with pytest.raises(ValueError, match="MTP head"):
        Engine(family_models / "qwen3_5", speculative="mtp")  # no mtp.* weights


@pytest.mark.parametrize("solo", ["compiled", "plain"], ids=["compiled", "uncompiled"])
@pytest.mark.parametrize("kept", [False, True], ids=["rejected", "all-kept"])
def test_each_proposal_is_the_head_s_on_the_target_s_own_hidden_states(mtp_model: Path, plain: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch, solo: str,
                                                                      kept: bool) -> None:
    expected, _ = run(plain, greedy(n=40))
    engine = always(Engine(mtp_model, speculative="mtp", solo=solo))
    assert (engine.graph is not None) == (solo == "compiled")
    monkeypatch.setattr("worker.mlx_engine.speculative.MTPDrafter", Spy)
    if kept:  # the record proposed in the head's place: every draft kept, the head's cache fed as far
        head = engine.speculation.head
        engine.speculation = Speculation("mtp", 4, oracle=PROMPT + expected, head=head)
    Spy.calls = []
    got, fin = run(engine, greedy(n=40))
    assert got == expected and fin is not None
    assert (fin.accepted_tokens == fin.drafted_tokens > 0) if kept else fin.drafted_tokens > 0
    assert len(Spy.calls) >= (8 if kept else 30)
    head = engine.speculation.head
    assert head is not None
    for history, drafts in Spy.calls:
        assert drafts == reference(engine, head, history, len(drafts)), len(history)


def test_a_seeded_sampled_request_drafting_with_the_head_gives_plain_seeded_ids(mtp_model: Path,
                                                                                plain: Engine) -> None:
    def seeded(cut: int = 0) -> Submit:
        return Submit(rid="s", max_tokens=30 - cut, prompt_ids=PROMPT, temperature=0.8, seed=3, ignore_eos=True,
                      resume_tokens=expected[:cut])

    expected: list[int] = []
    expected, _ = run(plain, seeded())
    engine = always(Engine(mtp_model, speculative="mtp"))
    for cut in (0, 7):
        got, fin = run(engine, seeded(cut))
        assert got == expected[cut:] and fin is not None and fin.drafted_tokens > 0


def test_a_second_request_takes_the_drafting_solo_into_the_batch_and_both_are_exact(mtp_model: Path,
                                                                                    plain: Engine) -> None:
    """The head has no hidden states in the batch: there it proposes nothing, and the ids stay plain's."""
    expected_a, _ = run(plain, greedy("a", n=40))
    expected_b, _ = run(plain, greedy("b", prompt=PROMPT[5:], n=20))
    engine = always(Engine(mtp_model, speculative="mtp"))
    engine.submit(greedy("a", n=40))
    got: dict[str, list[int]] = {}
    drive(engine, "a", until=12, got=got)
    engine.submit(greedy("b", prompt=PROMPT[5:], n=20))
    drive(engine, "b", got=got)
    drive(engine, "a", got=got)
    assert got["a"] == expected_a and got["b"] == expected_b


@pytest.mark.parametrize("bits", [None, 8], ids=["full", "kv8"])
def test_after_a_prefix_cache_hit_the_head_drafts_from_the_first_token_prefilled(mtp_model: Path, bits: int | None,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit's tokens came with no hidden states: the head's attention starts at the first position prefilled, its
    proposals are still the head's on what it saw, and the ids those of the same engine with drafting off."""
    cache = CacheOptions(hot_bytes=2**26, kv_bits=bits)
    reference_engine = Engine(mtp_model, speculative="off", cache=cache)
    expected, _ = run(reference_engine, greedy(n=30))
    again, _ = run(reference_engine, greedy(n=30))
    engine = always(Engine(mtp_model, speculative="mtp", cache=cache))
    first, _ = run(engine, greedy(n=30))
    monkeypatch.setattr("worker.mlx_engine.speculative.MTPDrafter", Spy)
    Spy.calls = []
    second, fin = run(engine, greedy(n=30))
    assert first == expected and second == again
    assert fin is not None and fin.cached_tokens > 0 and fin.drafted_tokens > 0 and Spy.calls


def test_a_request_decoded_compiled_before_leaves_the_next_one_its_own_hidden_states(
        mtp_model: Path, plain: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that does not draft decodes through the compiled graph, whose steps hand back the tapped hidden
    state too; the next request's first forward pass must read its own, not that one."""
    expected, _ = run(plain, greedy(n=30))
    engine = always(Engine(mtp_model, speculative="mtp", solo="compiled"))
    run(engine, greedy("x", prompt=PROMPT[3:], n=10, speculative=False))
    monkeypatch.setattr("worker.mlx_engine.speculative.MTPDrafter", Spy)
    Spy.calls = []
    got, _ = run(engine, greedy(n=30))
    head = engine.speculation.head
    assert got == expected and Spy.calls and isinstance(head, MTPHead)
    for history, drafts in Spy.calls:
        assert drafts == reference(engine, head, history, len(drafts)), len(history)
