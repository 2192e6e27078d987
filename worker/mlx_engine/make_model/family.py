"""What one architecture family is made of: its presets, its tokens, its chat template, its config files.

A `Family` is pure data plus two functions that write the family's `config.json` and
`generation_config.json` the way its real checkpoints do (real `model_type`, `architectures` and
field names), from a preset's dimensions and the ids the trained tokenizer gave its tokens.
No MLX here: the weights are built from `config.json` by mlx-lm's own model class (weights.py).

Invariants: every preset of a family that can be quantized keeps the input dimension of each
linear layer a multiple of 64 (the group size), so `--quantize` quantizes every layer mlx-lm's
converter would; `vocab_size` is the tokenizer's size, so no logit row lacks a token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

GROUP_SIZE = 64  # mlx-lm's default affine group size, and what `--quantize` uses

# Qwen's published pre-tokenizer splits (Qwen2/Qwen3; Qwen3.5 adds combining marks to letters). transformers 5
# rebuilds a qwen3_5 tokenizer around its own split whatever tokenizer.json says, so the BPE is trained with it.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN3_5_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class TokenSpec:
    """The added tokens of a family's tokenizer and the roles they play.

    `control` tokens are special (turn markers, BOS/EOS/padding: never text); `text` tokens are
    added tokens the format shows as text (Qwen's <think>, <tool_call>), not special, as in the
    real tokenizers. `stop` lists the generation EOS tokens in the order the real repo lists them.
    """

    control: tuple[str, ...]
    text: tuple[str, ...] = ()
    bos: str | None = None
    eos: str = ""
    pad: str | None = None
    unk: str | None = None
    stop: tuple[str, ...] = ()
    add_bos: bool = False  # encode() prepends BOS (Gemma), as the real tokenizer does
    split_regex: str | None = None  # the family's pre-tokenizer split (with NFC), else byte-level BPE's own
    tokenizer_extra: Mapping[str, object] = field(default_factory=dict)


TokenIds = Mapping[str, int]
ConfigFn = Callable[[Mapping, TokenIds, int], dict]
GenerationConfigFn = Callable[[TokenIds], dict]
MakeFn = Callable[[Path, str, int, "int | None"], dict]  # (out, preset, seed, quantize) -> what make_model returns


@dataclass(frozen=True)
class Family:
    """One architecture: `arch` is the `--arch` name; `configure(dims, ids, vocab)` returns config.json."""

    arch: str
    description: str
    presets: Mapping[str, Mapping]
    tokens: TokenSpec
    chat_template: str
    configure: ConfigFn
    generation_config: GenerationConfigFn | None = None
    template_file: bool = False  # chat_template.jinja (newer repos) rather than tokenizer_config.json
    tools: bool = True  # the chat template renders a tool list, tool calls and tool results
    make: MakeFn | None = None  # writes the whole folder itself (encoders, pooling models' extra files)


def shape_fields(dims: Mapping) -> dict:
    """The transformer's shape under the config names most families share (Qwen3, Qwen3.5, Gemma 3)."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size")
    return {k: dims[k] for k in keys}


def dtype_of(dims: Mapping) -> str:
    return str(dims.get("dtype", "float32"))


def ids_of(ids: TokenIds, names: tuple[str, ...]) -> list[int]:
    return [ids[n] for n in names]
