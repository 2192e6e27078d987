"""XLM-RoBERTa: a multilingual encoder as bge-m3 and multilingual-e5 ship it, for worker/mlx_engine/embedder.py.

config.json names `XLMRobertaModel` (model_type "xlm-roberta", Hugging Face's fields: pad_token_id 1, one token
type, LayerNorm eps 1e-5, and `max_position_embeddings` two more than the window, since positions count from
padding_idx + 1); tokenizer.json is a SentencePiece-style Unigram trained locally with `tokenizers` (NFKC with runs
of spaces collapsed, the Metaspace pre-tokenizer, `<s> $A </s>` around each input), with XLM-R's ids for
`<s> <pad> </s> <unk>` (0..3) and `<mask>` last; modules.json, 1_Pooling/config.json (CLS pooling, as bge-m3),
sentence_bert_config.json and config_sentence_transformers.json (no prompts). The weights are bert.py's model
class randomly initialised (XLM-R's parameters carry BERT's names and shapes) plus the pooler, in float32. Not
quantizable: the encoder is served unquantized.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model.encoders import bert_weights, make_encoder
from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec
from worker.mlx_engine.make_model.tokenizer import synthetic_corpus

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3, as XLM-R's fairseq dictionary has them
MASK = "<mask>"  # the last id, as in the real vocabulary
TOKENS = TokenSpec(control=(*SPECIALS, MASK), bos="<s>", eos="</s>", pad="<pad>", unk="<unk>")
POSITION_OFFSET = 2  # positions start at padding_idx + 1 = 2: the table has two rows more than the window

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab=1024,
                 max_seq_length=512),
    # multilingual-e5-small's shape (its vocabulary is 250002 pieces; the synthetic corpus yields fewer)
    "small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536, vocab=8192,
                  max_seq_length=512),
    # bge-m3's shape (XLM-R large, an 8192-token window): ~0.3B parameters besides the embedding table
    "1b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab=8192,
               max_seq_length=8192),
}


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        "architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"], "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"], "intermediate_size": dims["intermediate_size"],
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": dims["max_seq_length"] + POSITION_OFFSET, "type_vocab_size": 1,
        "initializer_range": 0.02, "layer_norm_eps": 1e-5, "bos_token_id": ids["<s>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["</s>"], "position_embedding_type": "absolute", "output_past": True, "use_cache": True,
        "classifier_dropout": None, "torch_dtype": "float32",
    }


def unigram(vocab: int, seed: int) -> Tokenizer:
    """A Unigram of about `vocab` pieces trained on the synthetic corpus, as XLM-R's tokenizer.json."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.Unigram())
    # the real one is SentencePiece's precompiled nmt_nfkc map, then the same collapse of space runs
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(MASK, lstrip=True, special=True)])
    bos, eos = ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0 </s>:0", pair="<s>:0 $A:0 </s>:0 </s>:0 $B:0 </s>:0", special_tokens=[bos, eos])
    return tok


def _write_tokenizer(out: Path, tok: Tokenizer, window: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "mask_token": MASK, "pad_token": "<pad>",
               "sep_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": window,
              "clean_up_tokenization_spaces": True, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def make(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    """The whole folder (see the module docstring); what was written, as make_model returns it."""
    return make_encoder(out, preset, seed, quantize, arch="xlm-roberta", presets=PRESETS, tokenizer=unigram,
                        tokens=TOKENS, configure=configure, write_tokenizer=_write_tokenizer, window="max_seq_length",
                        weights=bert_weights, pooling="cls")


XLM_ROBERTA = Family(arch="xlm-roberta",
                     description="XLM-RoBERTa encoder (bge-m3's files): Unigram, CLS pooling, sentence-transformers",
                     presets=PRESETS, tokens=TOKENS, chat_template="", configure=configure, tools=False, make=make)
