"""A model folder's config.json and weights' headers as numbers both sides can trust.

A config.json is input like any other: `num_hidden_layers: 1000000000` made mlx-lm build a billion layers before
it read a weight (the worker grew past 6 GB, unbounded, while its client waited), `hidden_size: -64` failed as
"math domain error", and `max_position_embeddings: 2**62` was published as the context length. So:

- `check_model(path)` (the worker's, before it builds any model): the numeric fields of the config (its text
  config, and each nested `text_config`, `vision_config`, `audio_config`) are integers (or finite numbers) within
  LIMITS, `num_key_value_heads` divides `num_attention_heads`, the rope parameters are positive and finite; and
  the layers the config claims are no more than the weights on disk hold (the `layers.N.` of the tensor names
  that each `*.safetensors` header lists). A refusal is a ConfigError naming the field and its value.
- `memory_estimate(config)` (the supervisor's admission): a generating model's KV bytes per token (every
  attention layer's K and V in the model's dtype) and what a first request costs on top of the weights: the KV of
  ESTIMATE_TOKENS tokens and one prefill chunk's logits; `runtime_bytes_at` counts that KV at a `[cache] kv_bits`.
- `context_length(config)`: max_position_embeddings (4096 when absent), never past MAX_CONTEXT.

Pure standard library, bounded reads: no MLX, no imports from either side.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

MAX_CONTEXT = 2**24  # the most context any model publishes (16.7M tokens), whatever its config claims
DEFAULT_CONTEXT = 4096  # a config that names no max_position_embeddings
ESTIMATE_TOKENS = 2048  # admission's estimate: one request's KV of this many tokens and one chunk's logits
CONFIG_MAX_BYTES = 16 * 2**20  # a config.json is a few KB; past this it is not read
HEADER_MAX_BYTES = 100 * 2**20  # the safetensors format's own bound on a header

# the values a field may hold: up to 10-100x past the largest published models', far below what would allocate
# without bound (a layer, a head or an expert is a Python object each; the rest sizes arrays); expert counts may be
# 0 (dense models' configs)
_LAYERS = 2**12
LIMITS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers"), (1, _LAYERS)),
    "hidden_size": (1, 2**17), "intermediate_size": (1, 2**20), "moe_intermediate_size": (0, 2**20),
    "num_attention_heads": (1, 2**12), "num_key_value_heads": (1, 2**12), "head_dim": (1, 2**12),
    "vocab_size": (1, 2**22), "max_position_embeddings": (1, 2**32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"), (0, 2**14)),
}
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
VISION_LAYER_FIELDS = ("depth",)  # a vision tower's layers (Qwen-VL's vision_config)
MAX_ROPE_THETA = 1e15
MAX_ROPE_FACTOR = 1e6  # rope_scaling's factor, beta_fast, ...: tens in real configs
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
_NESTED = ("text_config", "vision_config", "audio_config")
_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


class ConfigError(ValueError):
    """A model's config.json or weights refused: the message names the field (or file) and what is wrong."""


@dataclass(frozen=True)
class MemoryEstimate:
    kv_bytes_per_token: int = 0  # every attention layer's K and V of one token
    runtime_bytes: int = 0  # a first request's KV (kv_tokens, at full precision) and one prefill chunk's logits
    kv_dtype_bytes: int = 2  # the width of a K/V element (and of a quantized group's scale and bias)
    kv_tokens: int = 0  # the tokens whose KV runtime_bytes counts: ESTIMATE_TOKENS, or the context where shorter


def kv_bytes_at(kv_bytes_per_token: int, dtype_bytes: int, bits: int | None, group_size: int = 64) -> int:
    """A token's K/V bytes in the running cache at `bits` (None or 0: full precision): each element at
    `bits`, and each group of `group_size` elements a scale and a bias of the model's dtype (mlx-lm's
    QuantizedKVCache, worker/mlx_engine/quantized_kv.py)."""
    if not bits or kv_bytes_per_token <= 0:
        return kv_bytes_per_token
    elements = kv_bytes_per_token // dtype_bytes
    return elements * bits // 8 + elements // group_size * 2 * dtype_bytes


def runtime_bytes_at(runtime_bytes: int, kv_bytes_per_token: int, kv_tokens: int, dtype_bytes: int,
                     bits: int | None, group_size: int = 64) -> int:
    """`runtime_bytes` (MemoryEstimate's) with its first request's `kv_tokens` of K/V counted at `bits`
    (kv_bytes_at) instead of full precision: what a worker whose running cache is quantized needs past its weights."""
    saved = kv_bytes_per_token - kv_bytes_at(kv_bytes_per_token, dtype_bytes, bits, group_size)
    return runtime_bytes - kv_tokens * saved


def read_config(path: Path) -> dict:
    """config.json as a dict; ConfigError when it is missing, too large, not JSON or not an object."""
    file = path / "config.json"
    try:
        if file.stat().st_size > CONFIG_MAX_BYTES:
            raise ConfigError(f"config.json: {file.stat().st_size} bytes, more than {CONFIG_MAX_BYTES} read")
        config = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config.json: cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("config.json: not a JSON object")
    return config


def text_config(config: dict) -> dict:
    """What the text model reads: the config with its nested text_config's fields over it (Qwen3.5 and other
    multimodal layouts), as the worker's engine reads it."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _int_field(where: str, value: object, low: int, high: int) -> None:
    values = value if isinstance(value, list) and value and len(value) <= _LAYERS else [value]
    for v in values:  # intermediate_size may be a list, one a layer
        if not _is_int(v) or not low <= v <= high:
            raise ConfigError(f"config.json: {where} is {_shown(value)}; it must be an integer from {low} to {high}")


def _number(where: str, value: object, low: float, high: float, low_open: bool = True) -> None:
    ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bound = f"more than {low:g}" if low_open else f"at least {low:g}"
        raise ConfigError(f"config.json: {where} is {_shown(value)}; it must be a number {bound} and at most {high:g}")


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rope(where: str, rope: object) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: {where} is {_shown(rope)}; it must be an object or null")
    for key, value in rope.items():
        at = f"{where}.{key}"
        if value is None:  # unset, as at the top level
            continue
        if isinstance(value, dict):  # per layer type (transformers 5: {"full_attention": {...}, ...})
            _rope(at, value)
        elif key == "rope_theta":
            _number(at, value, 0.0, MAX_ROPE_THETA)
        elif key == "original_max_position_embeddings":
            _int_field(at, value, *LIMITS["max_position_embeddings"])
        elif key == "partial_rotary_factor":
            _number(at, value, 0.0, 1.0)
        elif key == "factor":
            _number(at, value, 0.0, MAX_ROPE_FACTOR)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            _number(at, value, 0.0, MAX_ROPE_FACTOR, low_open=False)  # beta_fast, low_freq_factor, mscale, ...
        elif isinstance(value, list):  # short_factor, long_factor (LongRoPE), mrope_section
            for i, v in enumerate(value):
                _number(f"{at}[{i}]", v, 0.0, MAX_ROPE_FACTOR, low_open=False)


def check_fields(config: dict, prefix: str = "") -> None:
    """One config level's numeric fields (LIMITS, heads, rope): ConfigError naming the first one wrong."""
    for name, (low, high) in LIMITS.items():
        value = config.get(name)
        if value is not None:
            _int_field(prefix + name, value, low, high)
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads):
        if kv_heads > heads or heads % kv_heads:
            raise ConfigError(f"config.json: {prefix}num_key_value_heads is {kv_heads}; it must divide "
                              f"{prefix}num_attention_heads ({heads})")
    hidden = config.get("hidden_size")
    if _is_int(heads) and _is_int(hidden) and config.get("head_dim") is None and hidden < heads:
        raise ConfigError(f"config.json: {prefix}hidden_size is {hidden}, less than {prefix}num_attention_heads "
                          f"({heads}): a head would have no dimensions")
    if config.get("rope_theta") is not None:
        _number(prefix + "rope_theta", config["rope_theta"], 0.0, MAX_ROPE_THETA)
    if config.get("partial_rotary_factor") is not None:
        _number(prefix + "partial_rotary_factor", config["partial_rotary_factor"], 0.0, 1.0)
    for name in _ROPE_DICTS:
        _rope(prefix + name, config.get(name))


def tensor_names(path: Path) -> list[str]:
    """The tensor names every `*.safetensors` of the folder lists in its header (read alone, bounded)."""
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < size <= min(HEADER_MAX_BYTES, file.stat().st_size - 8):
                    raise ConfigError(f"{file.name}: not a safetensors file (its header claims {size} bytes)")
                header = json.loads(f.read(size))
        except (OSError, ValueError, RecursionError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{file.name}: its safetensors header cannot be read: {exc}") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{file.name}: its safetensors header is not a JSON object")
        names += [n for n in header if n != "__metadata__"]
    return names


def weight_layers(names: list[str]) -> int | None:
    """The layers the weights hold: one past the highest `layers.N.` index among the names (None: none named)."""
    found = [int(m.group(1)) for n in names if (m := _LAYER_NAME.search(n))]
    return max(found) + 1 if found else None


def check_config(config: dict) -> list[tuple[dict, str]]:
    """Every level of the config (itself, its text_config, vision_config, audio_config) checked (check_fields);
    the levels with their fields' prefixes."""
    levels = [(config, "")]
    for name in _NESTED:
        nested = config.get(name)
        if nested is not None and not isinstance(nested, dict):
            raise ConfigError(f"config.json: {name} is {_shown(nested)}; it must be an object")
        if isinstance(nested, dict):
            levels.append((nested, f"{name}."))
    for level, prefix in levels:
        check_fields(level, prefix)
        for name in _layer_fields(prefix):
            if name not in LAYER_FIELDS and level.get(name) is not None:
                _int_field(prefix + name, level[name], 1, _LAYERS)
    return levels


def _layer_fields(prefix: str) -> tuple[str, ...]:
    return LAYER_FIELDS + VISION_LAYER_FIELDS if prefix == "vision_config." else LAYER_FIELDS


def check_model(path: Path) -> dict:
    """Refuse (ConfigError) a model whose config or weights' headers are hostile or inconsistent, before anything
    is built from them; the config when it passes."""
    config = read_config(path)
    levels = check_config(config)
    held = weight_layers(tensor_names(path))
    if held is not None:
        for level, prefix in levels:
            for name in _layer_fields(prefix):
                claimed = level.get(name)
                if _is_int(claimed) and claimed > held:
                    raise ConfigError(f"config.json: {prefix}{name} is {claimed} but the weights hold {held} layers")
    return config


def _int(config: dict, name: str, default: int = 0) -> int:
    value = config.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return default


def context_length(config: dict) -> int:
    """The context a model publishes: its max_position_embeddings (DEFAULT_CONTEXT when absent or not a positive
    integer), never past MAX_CONTEXT."""
    return min(_int(text_config(config), "max_position_embeddings", DEFAULT_CONTEXT), MAX_CONTEXT)


def dtype_bytes(config: dict) -> int:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return 4 if dtype == "float32" else 2


def memory_estimate(config: dict) -> MemoryEstimate:
    """A generating model's KV per token and a first request's runtime bytes, from its config (zero where the
    config says too little). Attention layers: those `layer_types` names full_attention, else every layer;
    a layer's K and V: num_key_value_heads x head_dim (hidden_size / num_attention_heads where not given)."""
    tc = text_config(config)
    layers = _int(tc, "num_hidden_layers")
    kinds = tc.get("layer_types")
    if isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds):
        layers = min(layers, sum(k == "full_attention" for k in kinds)) if layers else 0
    heads = _int(tc, "num_attention_heads")
    kv_heads = min(_int(tc, "num_key_value_heads", heads), LIMITS["num_key_value_heads"][1])
    head_dim = _int(tc, "head_dim") or (_int(tc, "hidden_size") // heads if heads else 0)
    width = dtype_bytes(tc)
    per_token = min(layers, _LAYERS) * 2 * kv_heads * min(head_dim, LIMITS["head_dim"][1]) * width
    tokens = min(ESTIMATE_TOKENS, context_length(config))
    logits = min(_int(tc, "vocab_size"), LIMITS["vocab_size"][1]) * tokens * width
    return MemoryEstimate(per_token, per_token * tokens + logits, width, tokens if per_token else 0)


def model_estimate(path: Path) -> MemoryEstimate:
    """memory_estimate of the folder's config.json; zero for one that cannot be read or that check_config refuses
    (admission lets its load fail, naming the field, rather than refuse it for the memory its claims would take)."""
    try:
        config = read_config(path)
        check_config(config)
    except ConfigError:
        return MemoryEstimate()
    return memory_estimate(config)
