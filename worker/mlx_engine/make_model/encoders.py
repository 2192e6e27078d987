"""BERT: an encoder as sentence-transformers repos ship it (all-MiniLM-L6-v2's files), for
worker/mlx_engine/embedder.py.

config.json names `BertModel` (model_type "bert", Hugging Face's fields); tokenizer.json is a lowercasing
WordPiece trained locally with `tokenizers` (BERT's normalizer and pre-tokenizer, `[CLS] $A [SEP]` around each
input, `##` continuations), with vocab.txt beside it; modules.json (Transformer, Pooling, Normalize),
1_Pooling/config.json (mean pooling), sentence_bert_config.json (max_seq_length) and
config_sentence_transformers.json (no prompts). The weights are bert.py's own model class randomly initialised,
plus BertModel's pooler, under Hugging Face's names, in float32 as the real checkpoint. Not quantizable: the
encoder is served unquantized.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec
from worker.mlx_engine.make_model.tokenizer import synthetic_corpus, token_ids

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4: [PAD] is 0, BERT's pad_token_id
TOKENS = TokenSpec(control=SPECIALS, eos="[SEP]", pad="[PAD]", unk="[UNK]")

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab=1024,
                 max_position_embeddings=512, max_seq_length=128),
    # all-MiniLM-L6-v2's shape (its vocabulary is 30522 WordPieces; the synthetic corpus yields fewer)
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, vocab=8192,
                  max_position_embeddings=512, max_seq_length=256),
    # BERT-large's shape (bge-large, e5-large): ~0.3B parameters, the largest common encoder
    "1b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab=8192,
               max_position_embeddings=512, max_seq_length=512),
}


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"], "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"], "intermediate_size": dims["intermediate_size"],
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": dims["max_position_embeddings"], "type_vocab_size": 2,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": ids["[PAD]"],
        "position_embedding_type": "absolute", "use_cache": True, "classifier_dropout": None,
        "gradient_checkpointing": False, "torch_dtype": "float32",
    }


def wordpiece(vocab: int, seed: int) -> Tokenizer:
    """A lowercasing WordPiece of about `vocab` tokens trained on the synthetic corpus, as BERT's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                        continuing_subword_prefix="##")
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    return with_cls_sep(tok)


def with_cls_sep(tok: Tokenizer) -> Tokenizer:
    """`[CLS] $A [SEP]` around each input (a pair: `$B [SEP]` after, type 1), as BERT's and ModernBERT's files say."""
    from tokenizers import processors

    cls, sep = ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1", special_tokens=[cls, sep])
    return tok


def _write_tokenizer(out: Path, tok: Tokenizer, window: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (out / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab))
    special = {"cls_token": "[CLS]", "mask_token": "[MASK]", "pad_token": "[PAD]", "sep_token": "[SEP]",
               "unk_token": "[UNK]"}
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "tokenize_chinese_chars": True,
              "strip_accents": None, "clean_up_tokenization_spaces": True, "model_max_length": window, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def write_sentence_transformers(out: Path, dims: Mapping, pooling: str = "mean",
                                prompts: Mapping[str, str] | None = None) -> None:
    """modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json pooling by `pooling` ("mean" or "cls"),
    sentence_bert_config.json (max_seq_length) and config_sentence_transformers.json with `prompts` (none unless
    given)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    config = {"word_embedding_dimension": dims["hidden_size"], "pooling_mode_cls_token": pooling == "cls",
              "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": dims["max_seq_length"], "do_lower_case": False}, indent=2))
    (out / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": dict(prompts or {}), "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))


def bert_weights(config: dict, seed: int) -> dict:
    """bert.py's model class randomly initialised, plus the pooler the real files carry (XLM-R's parameters have
    BERT's names and shapes too)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from worker.mlx_engine.bert import BertConfig, BertModel

    mx.random.seed(seed)
    weights: dict[str, mx.array] = dict(tree_flatten(BertModel(BertConfig.from_dict(config)).parameters()))
    hidden = config["hidden_size"]
    weights["pooler.dense.weight"] = mx.random.normal((hidden, hidden)) * config["initializer_range"]
    weights["pooler.dense.bias"] = mx.zeros((hidden,))
    return weights


def make_encoder(out: Path, preset: str, seed: int, quantize: int | None, *, arch: str, presets: Mapping,
                 tokenizer: Callable[[int, int], Tokenizer], tokens: TokenSpec,
                 configure: Callable[[Mapping, TokenIds, int], dict],
                 write_tokenizer: Callable[[Path, Tokenizer, int], None], window: str,
                 weights: Callable[[dict, int], dict], pooling: str = "mean", prompts: Mapping | None = None) -> dict:
    """An encoder's whole folder, as each family's module docstring says; what was written, as make_model returns
    it. Encoders are served unquantized."""
    import mlx.core as mx

    if quantize is not None:
        raise ValueError(f"--quantize is for decoders: the {arch} encoder is written unquantized")
    dims = presets[preset]
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(dims["vocab"], seed)
    config = configure(dims, token_ids(tok, tokens), tok.get_vocab_size())
    write_tokenizer(out, tok, dims[window])
    write_sentence_transformers(out, dims, pooling=pooling, prompts=prompts)
    tensors = weights(config, seed)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"path": str(out), "arch": arch, "preset": preset, "quantize": None, "vocab_size": tok.get_vocab_size(),
            "parameters": sum(v.size for v in tensors.values()), "bits_per_weight": None,
            "weights_bytes": (out / "model.safetensors").stat().st_size}


def make(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    """The whole folder (see the module docstring); what was written, as make_model returns it."""
    return make_encoder(out, preset, seed, quantize, arch="bert", presets=PRESETS, tokenizer=wordpiece, tokens=TOKENS,
                        configure=configure, write_tokenizer=_write_tokenizer, window="max_position_embeddings",
                        weights=bert_weights)


BERT = Family(arch="bert", description="BERT encoder (all-MiniLM's files): WordPiece, mean pooling, sentence-transformers",
              presets=PRESETS, tokens=TOKENS, chat_template="", configure=configure, tools=False, make=make)
