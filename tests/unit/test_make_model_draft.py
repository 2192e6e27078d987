"""`make-model --draft-for TARGET` (issue 30): a draft model with TARGET's tokenizer and vocabulary, which the worker
loads as TARGET's draft (speculative.load_draft), where a model made on its own would have another tokenizer.
Real MLX on the CPU, in process, tiny presets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from worker.mlx_engine.make_model import make_model
from worker.mlx_engine.make_model.__main__ import main
from worker.mlx_engine.speculative import load_draft

TEXT = "def merge_spans(spans):\n    return sorted(spans)  # é 日本 😀"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Targets (llama and qwen3, seed 1: a tokenizer the default seed does not train) and their drafts (seed 0)."""
    root = tmp_path_factory.mktemp("drafts")
    for arch in ("llama", "qwen3"):
        make_model(root / arch, "tiny", seed=1, arch=arch)
        assert main([str(root / f"{arch}-draft"), "--draft-for", str(root / arch), "--seed", "0"]) == 0
    make_model(root / "alone", "tiny", seed=0)  # what the draft would be without --draft-for
    return root


def config(path: Path) -> dict:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_draft_has_the_target_s_tokenizer_and_vocabulary(made: Path, arch: str) -> None:
    target, draft = made / arch, made / f"{arch}-draft"
    assert config(draft)["model_type"] == config(target)["model_type"] == arch  # the family read from TARGET
    assert config(draft)["vocab_size"] == config(target)["vocab_size"]
    t, d = load_tokenizer(target), load_tokenizer(draft)
    assert d.get_vocab() == t.get_vocab()
    assert d.encode(TEXT) == t.encode(TEXT)
    assert d.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=True) == \
        t.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=True)


def test_the_worker_loads_it_as_the_target_s_draft_and_refuses_a_model_made_alone(made: Path) -> None:
    tokenizer = load_tokenizer(made / "llama")
    model, weights = load_draft(made / "llama-draft", tokenizer)
    assert model.args.vocab_size == len(tokenizer.get_vocab()) and weights > 0
    with pytest.raises(ValueError, match="another tokenizer"):  # same preset, its own tokenizer: no draft
        load_draft(made / "alone", tokenizer)


def test_a_draft_of_another_family_or_for_no_model_is_refused(made: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "a"), "--draft-for", str(made / "llama"), "--arch", "qwen3"]) == 2
    assert main([str(tmp_path / "b"), "--draft-for", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("error:") == 2
    assert not (tmp_path / "a" / "config.json").exists() and not (tmp_path / "b" / "config.json").exists()
