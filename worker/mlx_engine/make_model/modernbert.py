"""ModernBERT: an encoder as nomic's modernbert-embed-base ships it, for worker/mlx_engine/embedder.py.

config.json names `ModernBertModel` (model_type "modernbert", Hugging Face's fields: rotary positions with a
global and a local theta, a global attention layer every `global_attn_every_n_layers` and a sliding window of
`local_attention` tokens in the others, GeGLU, no biases, exact GELU); tokenizer.json is a byte-level BPE trained
locally (tokenizer.py's) with ModernBERT's special tokens after the merges, as the real vocabulary has them
(`[UNK] [CLS] [SEP] [PAD] [MASK]`), `[CLS] $A [SEP]` around each input, and a vocab_size padded up to a multiple
of 64 as the real one is; modules.json, 1_Pooling/config.json (mean pooling), sentence_bert_config.json and
config_sentence_transformers.json with modernbert-embed's "search_query: " / "search_document: " prompts.
The weights are random under Hugging Face's ModernBertModel names, in float32. Not quantizable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model.encoders import make_encoder, with_cls_sep
from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec
from worker.mlx_engine.make_model.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIALS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")  # after the merges, in the real vocabulary's order
TOKENS = TokenSpec(control=SPECIALS, bos="[CLS]", eos="[SEP]", pad="[PAD]", unk="[UNK]")
PROMPTS = {"query": "search_query: ", "document": "search_document: "}

PRESETS: dict[str, dict] = {
    # three layers, so one global and two local; a window of 8 tokens, so short inputs reach past it
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, vocab=1024,
                 local_attention=8, max_position_embeddings=512, max_seq_length=512),
    # ModernBERT-base's shape (modernbert-embed-base, gte-modernbert-base): ~0.15B parameters
    "small": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152, vocab=8192,
                  local_attention=128, max_position_embeddings=8192, max_seq_length=8192),
    # ModernBERT-large's shape: ~0.4B parameters
    "1b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624, vocab=8192,
               local_attention=128, max_position_embeddings=8192, max_seq_length=8192),
}


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        "architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": -(-vocab_size // 64) * 64,
        "hidden_size": dims["hidden_size"], "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"], "intermediate_size": dims["intermediate_size"],
        "hidden_activation": "gelu", "max_position_embeddings": dims["max_position_embeddings"],
        "global_attn_every_n_layers": 3, "local_attention": dims["local_attention"], "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "mlp_dropout": 0.0, "embedding_dropout": 0.0, "norm_bias": False, "norm_eps": 1e-5, "layer_norm_eps": 1e-5,
        "initializer_range": 0.02, "initializer_cutoff_factor": 2.0, "classifier_pooling": "mean",
        "classifier_activation": "gelu", "classifier_bias": False, "classifier_dropout": 0.0, "decoder_bias": True,
        "deterministic_flash_attn": False, "sparse_prediction": False, "sparse_pred_ignore_index": -100,
        "repad_logits_with_grad": False, "position_embedding_type": "absolute",
        "bos_token_id": ids["[CLS]"], "cls_token_id": ids["[CLS]"], "eos_token_id": ids["[SEP]"],
        "sep_token_id": ids["[SEP]"], "pad_token_id": ids["[PAD]"], "torch_dtype": "float32",
    }


def bpe(vocab: int, seed: int) -> Tokenizer:
    """The byte-level BPE with ModernBERT's special tokens added after its merges and its post-processor."""
    from tokenizers import AddedToken

    tok = train_tokenizer(vocab - len(SPECIALS), seed)
    tok.add_special_tokens([AddedToken(t, lstrip=t == "[MASK]", special=True) for t in SPECIALS])
    return with_cls_sep(tok)


def _write_tokenizer(out: Path, tok: Tokenizer, window: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {"cls_token": "[CLS]", "mask_token": "[MASK]", "pad_token": "[PAD]", "sep_token": "[SEP]",
               "unk_token": "[UNK]"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": window,
              "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"], **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def weight_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """ModernBertModel's parameters by Hugging Face name (no biases; layer 0 has no attention norm)."""
    d, inner = config["hidden_size"], config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"embeddings.tok_embeddings.weight": (config["vocab_size"], d),
                                          "embeddings.norm.weight": (d,), "final_norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        if i:
            shapes[f"layers.{i}.attn_norm.weight"] = (d,)
        shapes.update({f"layers.{i}.attn.Wqkv.weight": (3 * d, d), f"layers.{i}.attn.Wo.weight": (d, d),
                       f"layers.{i}.mlp_norm.weight": (d,), f"layers.{i}.mlp.Wi.weight": (2 * inner, d),
                       f"layers.{i}.mlp.Wo.weight": (d, inner)})
    return shapes


def _weights(config: dict, seed: int) -> dict:
    import mlx.core as mx

    mx.random.seed(seed)

    def init(shape: tuple[int, ...]) -> mx.array:
        if len(shape) == 1:
            return 1.0 + 0.1 * mx.random.normal(shape)  # norms near one, not exactly: their weights then matter
        return mx.random.normal(shape) * shape[1] ** -0.5  # unit-variance outputs: attention far from uniform

    return {name: init(shape) for name, shape in weight_shapes(config).items()}


def make(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    """The whole folder (see the module docstring); what was written, as make_model returns it."""
    return make_encoder(out, preset, seed, quantize, arch="modernbert", presets=PRESETS, tokenizer=bpe, tokens=TOKENS,
                        configure=configure, write_tokenizer=_write_tokenizer, window="max_seq_length",
                        weights=_weights, pooling="mean", prompts=PROMPTS)


MODERNBERT = Family(arch="modernbert",
                    description="ModernBERT encoder (modernbert-embed's files): byte-level BPE, mean pooling, prompts",
                    presets=PRESETS, tokens=TOKENS, chat_template="", configure=configure, tools=False, make=make)
