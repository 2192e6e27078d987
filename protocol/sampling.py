"""A model's own default sampling: its folder's generation_config.json, and what `mlxsup import` writes there.

Most clients send no temperature, and a request that names none used to sample at 1.0 whatever the model: a small
instruct model (the demo's SmolLM2-135M) answers gibberish at 1.0. So a request's unset sampling fields take the
model's defaults (supervisor/sampling.py resolves them: request, then `[models.ID]`, then the folder's file, then
the server's), and these are read here:

- `read(folder)`: generation_config.json's temperature, top_p, top_k, min_p and repetition_penalty, each within
  RANGES (a value out of range, or of the wrong type, is dropped and named in the problems, never applied);
  `do_sample: false` means greedy (temperature 0), whatever else the file says. Hugging Face's own defaults for
  fields the file does not name (its top_k of 50) are not taken: an absent field is unset here.
- `check(values, where)`: the same ranges for the config's `[models.ID]` keys; a bad value is a ValueError naming it.
- `from_gguf(meta)`: a GGUF's `general.sampling.*` keys (llama.cpp's converter writes them from the model's
  generation_config), else `published(...)`: the defaults of a few base models the importer knows, by the file's
  `general.basename` and `general.size_label` (SmolLM2's GGUF carries no sampling keys). `generation_config(sampling)`
  is the file to write.

Pure standard library, bounded reads: no MLX, no imports from either side.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
MAX_BYTES = 2**20  # a generation_config.json is a few hundred bytes
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# the values a default may hold: the chat API's ranges for the same request fields (openai_api._sampling)
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, 1_000_000), "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 10.0),
}
# a GGUF's general.sampling.* keys (gguf.Keys.General.SAMPLING_*) by the field they set
GGUF_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}
# Defaults of base models whose GGUF files commonly carry no sampling keys, by a pattern of the file's
# `general.basename` and `general.size_label` (or its `general.name`), with where each comes from. First match wins.
PUBLISHED: tuple[tuple[re.Pattern[str], dict[str, float | int], str], ...] = (
    # The demo's. Its first token for a plain question is a near-tie: for the README's "What is the capital of
    # France?", "The" and "L" are 0.08 logits apart, so at the model card's 0.2 / 0.9 it answered "L'Étoile ... is
    # the capital of France" or looped ("la femme, la femme, ...") in 5 of 24 seeded runs. Greedy answers it.
    (re.compile(r"smollm2\W*135m", re.I), {"temperature": 0.0},
     "greedy: SmolLM2-135M samples wrong answers at its model card's 0.2"),
    # SmolLM2's generation_config.json names no sampling; the model card's example samples at 0.2 / 0.9
    (re.compile(r"smollm2", re.I), {"temperature": 0.2, "top_p": 0.9}, "the SmolLM2-Instruct model card"),
    (re.compile(r"qwen3", re.I), {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, "Qwen3's generation_config.json"),
    (re.compile(r"qwen2\.5", re.I), {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
     "Qwen2.5-Instruct's generation_config.json"),
    (re.compile(r"llama[- ]?3", re.I), {"temperature": 0.6, "top_p": 0.9}, "Llama 3's generation_config.json"),
)


@dataclass(frozen=True)
class Sampling:
    """Sampling defaults, each None where unset (the next source decides)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Sampling:
        return cls(**{k: v for k, v in values.items() if k in FIELDS})

    def items(self) -> dict[str, float | int]:
        """The fields set, by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def __bool__(self) -> bool:
        return bool(self.items())


def _value(key: str, value: Any) -> float | int | None:
    """`value` as the field's type when it is within its range, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    lo, hi = RANGES[key]
    if key == "top_k":
        if value != int(value) or not lo <= value <= hi:
            return None
        return int(value)
    return float(value) if lo <= value <= hi else None


def check(values: Mapping[str, Any], where: str) -> Sampling:
    """The config's sampling keys (FIELDS) of `values`; a value of the wrong type or out of range is a ValueError."""
    out: dict[str, float | int] = {}
    for key in FIELDS:
        if key not in values:
            continue
        value = _value(key, values[key])
        if value is None:
            lo, hi = RANGES[key]
            kind = "an integer" if key == "top_k" else "a number"
            raise ValueError(f"{where}.{key}: must be {kind} from {lo:g} to {hi:g}, got {values[key]!r}")
        out[key] = value
    return Sampling.of(out)


def from_config(config: Mapping[str, Any]) -> tuple[Sampling, list[str]]:
    """(the defaults a generation_config holds, what was wrong with it: the fields dropped)."""
    problems: list[str] = []
    out: dict[str, float | int] = {}
    for key in FIELDS:
        if config.get(key) is None:
            continue
        value = _value(key, config[key])
        if value is None:
            problems.append(f"{key} = {config[key]!r} is not within {RANGES[key][0]:g}..{RANGES[key][1]:g}: ignored")
        else:
            out[key] = value
    if config.get("do_sample") is False:  # Hugging Face's greedy: the temperature and the truncations mean nothing
        out = {k: v for k, v in out.items() if k == "repetition_penalty"} | {"temperature": 0.0}
    return Sampling.of(out), problems


def read(folder: Path) -> tuple[Sampling, list[str]]:
    """The defaults of a model folder's generation_config.json (none when it has none), and its problems."""
    path = folder / FILE
    try:
        if not path.is_file():
            return Sampling(), []
        if path.stat().st_size > MAX_BYTES:
            return Sampling(), [f"{path}: over {MAX_BYTES} bytes, not read"]
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return Sampling(), [f"{path}: cannot be read ({exc})"]
    if not isinstance(config, dict):
        return Sampling(), [f"{path}: not a JSON object"]
    sampling, problems = from_config(config)
    return sampling, [f"{path}: {p}" for p in problems]


def from_gguf(meta: Mapping[str, Any]) -> tuple[Sampling, str | None]:
    """(a GGUF's sampling defaults, where they come from): its `general.sampling.*` keys, else a known base model's
    published defaults (PUBLISHED), else none."""
    def scalar(key: str) -> Any:
        value: Any = meta.get(key)
        try:
            return value.item() if hasattr(value, "item") else value  # MLX hands numbers back as 0-d arrays
        except (ValueError, TypeError):  # an array of several values: no one number
            return None

    found = {field: float(f"{value:.6g}") if isinstance(value, float) else value  # float32 in the file: 0.4, not 0.400000006
             for key, field in GGUF_KEYS.items()
             if (value := _value(field, scalar(f"general.sampling.{key}"))) is not None}
    if found:
        return Sampling.of(found), "the GGUF's general.sampling metadata"
    sized = f"{scalar('general.basename') or ''} {scalar('general.size_label') or ''}".strip()
    return published(sized, str(scalar("general.name") or ""))


def published(*names: str) -> tuple[Sampling, str | None]:
    """A known base model's defaults, by the first of `names` ("basename size_label", name) a PUBLISHED pattern
    matches; (no defaults, None) for any other model."""
    for name in names:
        for pattern, values, source in PUBLISHED:
            if name and pattern.search(name):
                return Sampling.of(values), source
    return Sampling(), None


def generation_config(sampling: Sampling) -> dict[str, Any]:
    """A generation_config.json that holds `sampling` (do_sample false: greedy, at temperature 0). No token ids:
    mlx-lm takes an `eos_token_id` here over config.json's, and config.json has them already."""
    values = sampling.items()
    return {"do_sample": values.get("temperature", 1.0) > 0, **values}
