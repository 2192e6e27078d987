"""The tokenizer of a made model: a byte-level BPE trained offline on a synthetic corpus, plus the family's tokens.

The BPE is trained locally with `tokenizers` on a deterministic corpus, so any UTF-8 input
encodes and the same (vocab, seed) always yields the same tokenizer. The family's control
tokens are the trainer's special tokens (they get the first ids and are never split); its text
tokens are added afterwards as non-special added tokens, as the real tokenizers mark them.

`tokenizer_class` is the generic `PreTrainedTokenizerFast` for every family: transformers 5's
family classes (Qwen2Tokenizer, GemmaTokenizer) rebuild their own pre-tokenizer from the vocab
and merges instead of reading tokenizer.json, which would not encode like the trained BPE.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model.family import Family, TokenSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def synthetic_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text: syllable words, numbers, punctuation, some non-ASCII."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "ch", "sh", "th", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    words += ["é", "ü", "ß", "日本", "語", "😀", "def", "return", "{", "}", "(", ")", "=", "+", "\n"]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line.capitalize() + rng.choice([".", "!", "?", ",", ":"]))
    return lines


def train_tokenizer(vocab: int, seed: int, special_tokens: tuple[str, ...] | list[str] = (),
                    split_regex: str | None = None) -> Tokenizer:
    """A byte-level BPE of about `vocab` tokens (special tokens included), trained on the synthetic corpus.

    `split_regex`: the family's own pre-tokenizer split (then NFC-normalised), instead of byte-level's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    return tok


def build_tokenizer(spec: TokenSpec, vocab: int, seed: int) -> Tokenizer:
    """The trained BPE with the family's control tokens (special) and text tokens (not special)."""
    from tokenizers import AddedToken, processors

    tok = train_tokenizer(vocab, seed, spec.control, spec.split_regex)
    if spec.text:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.text])
    if spec.add_bos and spec.bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)])
    return tok


def token_ids(tok: Tokenizer, spec: TokenSpec) -> dict[str, int]:
    """Every added token's id, by name."""
    ids = {name: tok.token_to_id(name) for name in (*spec.control, *spec.text)}
    missing = sorted(name for name, i in ids.items() if i is None)
    if missing:
        raise ValueError(f"tokens missing from the trained tokenizer: {missing}")
    return {name: int(i) for name, i in ids.items() if i is not None}


def write_tokenizer(out: Path, tok: Tokenizer, family: Family, context_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template, or chat_template.jinja beside it)
    and special_tokens_map.json."""
    spec = family.tokens
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        **spec.tokenizer_extra,
    }
    if family.template_file:
        (out / "chat_template.jinja").write_text(family.chat_template)
    else:
        config["chat_template"] = family.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special: Mapping[str, str | None] = {"bos_token": spec.bos, "eos_token": spec.eos, "pad_token": spec.pad,
                                         "unk_token": spec.unk}
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in special.items() if v is not None}, indent=2))
