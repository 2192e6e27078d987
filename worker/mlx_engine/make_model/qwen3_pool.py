"""Qwen3-Embedding and Qwen3-Reranker: a Qwen3 dense decoder (mlx-lm's class, qwen3.py's config) with the files
their real repos ship around it, for worker/mlx_engine/decoder_pool.py.

Embedding (Qwen3-Embedding-0.6B's files): sentence-transformers' modules.json (Transformer, Pooling, Normalize),
1_Pooling/config.json with last-token pooling, config_sentence_transformers.json with the instruction `prompts`
("query" and an empty "document"), sentence_bert_config.json; the tokenizer's post-processor appends
`<|endoftext|>` to every input, and tokenizer_config.json pads on the left, as the real tokenizer does.
Reranker (Qwen3-Reranker-0.6B's files): only the decoder and its tokenizer, which has single tokens "yes" and
"no" (ordinary BPE tokens in the real vocabulary, added tokens here: a trained BPE may not merge them); config.json
carries what marks it a reranker where the real repo has nothing but its name: `_name_or_path`, and vLLM's
`classifier_from_token` / `is_original_qwen3_reranker` (what `vllm serve --hf_overrides` sets for this model).
Weights are written in mlx-lm's layout (`model.` prefix), as mlx-community's conversions are; the loader reads
the real repo's bare Qwen3Model layout too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from worker.mlx_engine.make_model.chatml import QWEN3_TEMPLATE, QWEN_TEXT_TOKENS
from worker.mlx_engine.make_model.family import Family, TokenIds, dtype_of
from worker.mlx_engine.make_model.qwen3 import DENSE_PRESETS, TOKENS, configure_dense, generation_config
from worker.mlx_engine.make_model.tokenizer import build_tokenizer, token_ids, write_tokenizer

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
RERANK_TOKENS = ("no", "yes")  # vLLM's classifier_from_token order: the score is P(the second)

# Qwen3 dense shapes; the real models' windows (32768 embedding, 40960 reranker; 8192 tokens per input in
# sentence-transformers), but a 512-token window in tiny so an over-window input stays cheap in tests.
EMBEDDING_PRESETS = {name: {**dims, "max_position_embeddings": 512 if name == "tiny" else 32768,
                            "max_seq_length": 512 if name == "tiny" else 8192}
                     for name, dims in DENSE_PRESETS.items()}
RERANKER_PRESETS = {name: {**dims, "max_position_embeddings": 512 if name == "tiny" else 40960}
                    for name, dims in DENSE_PRESETS.items()}

EMBEDDING_TOKENS = replace(TOKENS, tokenizer_extra={**TOKENS.tokenizer_extra, "padding_side": "left"})
RERANKER_TOKENS = replace(TOKENS, text=(*QWEN_TEXT_TOKENS, *RERANK_TOKENS))


def _make(family: Family, out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    """qwen3's folder (make_model's steps) with the pooling model's tokenizer, config fields and extra files."""
    from tokenizers import processors

    from worker.mlx_engine.make_model.weights import write_weights

    dims = family.presets[preset]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family.tokens, dims["vocab"], seed)
    embedding = family is QWEN3_EMBEDDING
    if embedding:  # Qwen3-Embedding's tokenizer.json: every input ends in <|endoftext|>, the pooled token
        eot = ("<|endoftext|>", tok.token_to_id("<|endoftext|>"))
        tok.post_processor = processors.TemplateProcessing(
            single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1", special_tokens=[eot])
    ids = token_ids(tok, family.tokens)
    config = family.configure(dims, ids, tok.get_vocab_size())
    write_tokenizer(out, tok, family, dims["max_position_embeddings"])
    (out / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2))
    written = write_weights(out, config, dtype_of(dims), seed, quantize)
    if embedding:
        _write_sentence_transformers(out, dims)
    else:  # mlx-lm's save_config drops _name_or_path; the reranker keeps it as its mark (see the docstring)
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({"_name_or_path": f"Qwen3-Reranker-{preset}", **saved}, indent=4))
    return {"path": str(out), "arch": family.arch, "preset": preset, "quantize": quantize,
            "vocab_size": tok.get_vocab_size(), **written}


def _write_sentence_transformers(out: Path, dims: Mapping) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling = {"word_embedding_dimension": dims["hidden_size"], "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": True, "include_prompt": True}
    st = {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
          "similarity_fn_name": "cosine"}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps(st, indent=2))
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": dims["max_seq_length"], "do_lower_case": False}, indent=2))


def configure_reranker(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {**configure_dense(dims, ids, vocab_size), "classifier_from_token": list(RERANK_TOKENS),
            "is_original_qwen3_reranker": True}


def make_embedding(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    return _make(QWEN3_EMBEDDING, out, preset, seed, quantize)


def make_reranker(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    return _make(QWEN3_RERANKER, out, preset, seed, quantize)


QWEN3_EMBEDDING = Family(
    arch="qwen3-embedding", description="Qwen3-Embedding: a Qwen3 decoder, last-token pooling, query prompt",
    presets=EMBEDDING_PRESETS, tokens=EMBEDDING_TOKENS, chat_template=QWEN3_TEMPLATE, configure=configure_dense,
    make=make_embedding)
QWEN3_RERANKER = Family(
    arch="qwen3-reranker", description="Qwen3-Reranker: a Qwen3 decoder scored by its yes/no logits",
    presets=RERANKER_PRESETS, tokens=RERANKER_TOKENS, chat_template=QWEN3_TEMPLATE, configure=configure_reranker,
    make=make_reranker)
