"""A DFlash drafter drafts a block at a time, and plain decoding's tokens come out (issue 52).

Real MLX on the CPU: random-weight drafters of the checkpoints' layout (`make-model --dflash-for TARGET`: dflash-mlx's
DFlashDraftModel) for a tiny llama (KV caches, rejected drafts trimmed) and a tiny Qwen3.5 (recurrent layers, marked
and re-fed), the product's Engine driven by submit/step. Random weights keep few drafts, so every proposal is checked
against the drafter run from scratch on the target's own layer outputs over the whole history, rejected and with a
record proposed in its place (all kept), compiled and not; then the ids, greedy and seeded, whole and resumed, and
the supervisor's reading of a draft folder's kind.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from protocol.messages import Submit
from supervisor.draft_config import speculative_args
from worker.mlx_engine.dflash import DFlashDrafter, DFlashHead
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.speculative import Speculation
from worker.mlx_engine.taps import tap_of

from .test_mtp import spying
from .test_speculative import PROMPT, greedy, run


@pytest.fixture(scope="module")
def drafters(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model.weights import write_dflash_drafter

    root = tmp_path_factory.mktemp("dflash")
    for name in ("llama", "qwen3_5"):
        write_dflash_drafter(root / name, family_models / name, seed=0)
    return root


def engine_for(family_models: Path, drafters: Path, name: str, **kw: object) -> Engine:
    engine = Engine(family_models / name, speculative="dflash", draft=drafters / name, **kw)  # type: ignore[arg-type]
    engine.speculation.pricing = None  # type: ignore[assignment]  # draft at every step at the full length
    return engine


Spy = spying(DFlashDrafter)


def reference(engine: Engine, head: DFlashHead, history: list[int], k: int) -> list[int]:
    """The drafter's k greedy drafts after `history`, from scratch: its context the target's tapped layers over all
    but the last token, its block [last token, mask, ...]."""
    tap = tap_of(engine.model)
    assert tap is not None
    tap.on = True
    try:
        engine.model(mx.array(history[:-1])[None])
    finally:
        tap.on = False
    context = tap.take()
    assert context is not None
    block = mx.array([[history[-1]] + [head.mask_id] * k], mx.uint32)
    out = head.forward(block, context, head.make_cache())
    return [int(t) for t in mx.argmax(head.logits(out[:, 1:])[0], axis=-1).tolist()]


@pytest.mark.parametrize("name, solo", [("llama", "compiled"), ("llama", "plain"), ("qwen3_5", "compiled"),
                                        ("qwen3_5", "plain")])
@pytest.mark.parametrize("kept", [False, True], ids=["rejected", "all-kept"])
def test_each_block_is_the_drafter_s_on_the_target_s_own_layers(family_models: Path, drafters: Path,
                                                                monkeypatch: pytest.MonkeyPatch, name: str,
                                                                solo: str, kept: bool) -> None:
    expected, _ = run(Engine(family_models / name, speculative="off"), greedy(n=40))
    engine = engine_for(family_models, drafters, name, solo=solo)
    assert (engine.graph is not None) == (solo == "compiled")
    monkeypatch.setattr("worker.mlx_engine.speculative.DFlashDrafter", Spy)
    head = engine.speculation.head
    assert isinstance(head, DFlashHead)
    if kept:
        engine.speculation = Speculation("dflash", 4, oracle=PROMPT + expected, head=head)
    Spy.calls = []
    got, fin = run(engine, greedy(n=40))
    assert got == expected and fin is not None
    assert (fin.accepted_tokens == fin.drafted_tokens > 0) if kept else fin.drafted_tokens > 0
    assert len(Spy.calls) >= (8 if kept else 30)
    for history, drafts in Spy.calls:
        assert drafts == reference(engine, head, history, len(drafts)), len(history)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_seeded_sampled_request_drafting_blocks_gives_plain_seeded_ids(family_models: Path, drafters: Path,
                                                                        name: str) -> None:
    def seeded(cut: int = 0) -> Submit:
        return Submit(rid="s", max_tokens=30 - cut, prompt_ids=PROMPT, temperature=0.8, seed=3, ignore_eos=True,
                      resume_tokens=expected[:cut])

    expected: list[int] = []
    expected, _ = run(Engine(family_models / name, speculative="off"), seeded())
    engine = engine_for(family_models, drafters, name)
    for cut in (0, 7):
        got, fin = run(engine, seeded(cut))
        assert got == expected[cut:] and fin is not None and fin.drafted_tokens > 0


def test_a_draft_folder_s_kind_picks_the_mode_and_a_wrong_drafter_is_refused(family_models: Path, drafters: Path,
                                                                            tmp_path: Path) -> None:
    assert Engine(family_models / "llama", speculative="dflash", draft=drafters / "llama").speculation.k == 7
    args, weights = speculative_args({"draft": str(drafters / "llama")}, "models.m", tmp_path)
    assert args[:2] == ("--speculative", "dflash") and weights > 0
    args, _ = speculative_args({"draft": str(family_models / "llama")}, "models.m", tmp_path)
    assert args[:2] == ("--speculative", "draft")
    with pytest.raises(ValueError, match="goes with a `draft`"):
        speculative_args({"speculative": "dflash"}, "models.m", tmp_path)
    with pytest.raises(ValueError, match="for another model"):
        Engine(family_models / "qwen3", speculative="dflash", draft=drafters / "qwen3_5")
