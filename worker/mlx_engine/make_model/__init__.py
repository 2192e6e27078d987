"""Write a random-weight model of a real architecture family that `mlx_lm.load(DIR)` loads offline.

There is no model hub here: tests, the demo and the benchmarks run on these. Each family is built
by mlx-lm's own model class from a config.json with the real checkpoints' fields, so loading it
builds the same layers and the same cache types (KVCache, RotatingKVCache, ArraysCache) the real
models build; random weights speak gibberish but cost what trained ones of the same shape cost.
The tokenizer is a byte-level BPE trained locally, carrying the family's real special tokens and
a chat template in the family's real format.

    python -m worker.mlx_engine.make_model DIR [--arch ARCH] [--preset tiny|small|1b] [--quantize 4|8] [--seed N]

Layout: family.py (what a family is), one module per family (llama, qwen3 with qwen3_moe, qwen3_5,
gemma3, gpt_oss; vlm.py: qwen3_vl, gemma3_vl; qwen3_pool.py: qwen3-embedding, qwen3-reranker;
the encoders encoders.py: bert, xlm_roberta.py, modernbert.py, which write their folders themselves; the audio
models whisper.py and kokoro.py, on mlx-audio's classes),
chatml.py / harmony.py (chat templates), tokenizer.py, weights.py (MLX, imported only when weights are written). Importing this package does
not import MLX.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.mlx_engine.make_model.encoders import BERT
from worker.mlx_engine.make_model.family import Family
from worker.mlx_engine.make_model.gemma3 import GEMMA3
from worker.mlx_engine.make_model.gpt_oss import GPT_OSS
from worker.mlx_engine.make_model.kokoro import KOKORO
from worker.mlx_engine.make_model.llama import FAMILY as LLAMA
from worker.mlx_engine.make_model.modernbert import MODERNBERT
from worker.mlx_engine.make_model.qwen3 import QWEN3, QWEN3_MOE
from worker.mlx_engine.make_model.qwen3_5 import QWEN3_5
from worker.mlx_engine.make_model.qwen3_pool import QWEN3_EMBEDDING, QWEN3_RERANKER
from worker.mlx_engine.make_model.tokenizer import (
    build_tokenizer,
    synthetic_corpus,
    token_ids,
    train_tokenizer,
    write_tokenizer,
)
from worker.mlx_engine.make_model.vlm import GEMMA3_VL, QWEN3_VL
from worker.mlx_engine.make_model.whisper import WHISPER
from worker.mlx_engine.make_model.xlm_roberta import XLM_ROBERTA

FAMILIES: dict[str, Family] = {f.arch: f for f in (LLAMA, QWEN3, QWEN3_MOE, GEMMA3, GPT_OSS, QWEN3_5,
                                                   QWEN3_EMBEDDING, QWEN3_RERANKER, BERT, QWEN3_VL, GEMMA3_VL,
                                                   XLM_ROBERTA, MODERNBERT, WHISPER, KOKORO)}
PRESET_NAMES = ("tiny", "small", "1b")
QUANTIZE_BITS = (4, 8)
PRESETS = LLAMA.presets  # the default family's, as before families existed

__all__ = ["FAMILIES", "PRESETS", "PRESET_NAMES", "QUANTIZE_BITS", "make_model", "synthetic_corpus",
           "train_tokenizer"]


def context_length(config: dict) -> int:
    text = config.get("text_config") or {}
    return int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096)


def make_model(out: Path, preset_name: str = "tiny", seed: int = 0, arch: str = "llama",
               quantize: int | None = None) -> dict:
    """Write the model into `out`; return what was written (parameters, bytes, vocabulary...)."""
    from worker.mlx_engine.make_model.weights import write_weights

    family = FAMILIES[arch]
    dims = family.presets[preset_name]
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise ValueError(f"--quantize takes {' or '.join(map(str, QUANTIZE_BITS))}, not {quantize}")
    if family.make is not None:
        return family.make(out, preset_name, seed, quantize)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family.tokens, dims["vocab"], seed)
    ids = token_ids(tok, family.tokens)
    config = family.configure(dims, ids, tok.get_vocab_size())
    write_tokenizer(out, tok, family, context_length(config))
    if family.generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(family.generation_config(ids), indent=2))
    written = write_weights(out, config, str(dims.get("dtype", "float32")), seed, quantize)
    return {"path": str(out), "arch": arch, "preset": preset_name, "quantize": quantize,
            "vocab_size": tok.get_vocab_size(), **written}
