"""The bench's chat prompts: random words of make-model's training corpus, the same for every side.

A module of its own so that every section (run.py's, prefill_itl.py, group_bench.py, diagnose.py) takes its
prompts from one place without importing bench.run, which imports the sections. Imports no MLX.
"""

from __future__ import annotations

import random

_WORDS: list[str] | None = None


def _vocabulary() -> list[str]:
    """Words of the corpus `mlxsup make-model` trains its tokenizer on (few tokens per word)."""
    global _WORDS
    if _WORDS is None:
        try:
            from worker.mlx_engine.make_model import synthetic_corpus  # pure Python, no MLX

            _WORDS = sorted({w.strip(".,!?:").lower() for line in synthetic_corpus(0, 400) for w in line.split()
                             if w.isascii() and w.strip(".,!?:").isalpha()})
        except Exception:
            syl = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el", "or", "us", "it"]
            _WORDS = [a + b for a in syl for b in syl]
    return _WORDS


def prompts(tag: str, n: int, n_words: int, seed: int) -> list[list[dict]]:
    """n distinct chat prompts of n_words random words; the same tag gives every side the same prompts."""
    vocab = _vocabulary()
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}/{tag}/{i}")
        out.append([{"role": "user", "content": " ".join(rng.choice(vocab) for _ in range(n_words)).capitalize()}])
    return out
