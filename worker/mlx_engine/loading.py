"""A model brought into memory before Ready: mlx_lm.load, lazily, then its weights evaluated in slices so the
worker can report how far it is (`load_with_progress`, the Engine's default loader; a group's rank loads its
shard instead, worker/mlx_engine/group.py), and the first token's cost timed for the step cost model.

Invariant: what these return is evaluated: the first request pays for no weight reads and no first kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tokenizer_utils import TokenizerWrapper


def load_with_progress(model_path: Path, report: Callable[[str, float], None]) -> tuple:
    """mlx_lm.load, lazily, then the weights brought into memory in slices, reporting the fraction done."""
    report("reading", 0.0)
    model, tokenizer = cast(tuple[nn.Module, TokenizerWrapper], load(str(model_path), lazy=True))
    leaves = [cast(mx.array, kv[1]) for kv in tree_flatten(model.parameters())]
    total = sum(v.nbytes for v in leaves) or 1
    done, reported = 0, 0.0
    for leaf in leaves:
        mx.eval(leaf)
        done += leaf.nbytes
        if done / total - reported >= 0.05:
            reported = done / total
            report("weights", reported)
    mx.eval(model(mx.array([[0]])))  # compiles the first kernels now, not in the first request
    return model, tokenizer


def time_one_token(model: nn.Module) -> float:
    """Seconds of one token's forward pass: the step cost model's seed, more than a prefilled token costs."""
    t0 = time.perf_counter()
    mx.eval(model(mx.array([[0]])))
    return time.perf_counter() - t0
