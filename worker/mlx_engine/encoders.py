"""The encoder families an Embedder (embedder.py) runs, each as one call: token ids [batch, n], right-padded with
the model's pad id, and a 0/1 attention mask -> the last hidden states [batch, n, hidden].

BERT is ours (bert.py). XLM-RoBERTa (bge-m3, multilingual-e5) and ModernBERT (modernbert-embed, gte-modernbert)
are mlx-vlm's classes, imported only when such a model loads, so a worker without mlx-vlm still serves BERT.

Why mlx-vlm's (0.7.10) and not mlx-embeddings' (0.1.0). Correctness, against transformers' own XLMRobertaModel
and ModernBertModel (torch, CPU) on make-model's folders, batched with padding and alone (tests/unit/
test_encoders.py): XLM-R matches to float32 rounding (~1e-7 on the vectors; its position ids count non-pad tokens
from padding_idx + 1, so padding must be the pad id, as Embedder pads). ModernBERT's MLP uses the tanh
approximation of GELU where ModernBERT's configs say "gelu" (exact, erf): the vectors then differ from
transformers' by ~6e-5, so `load_encoder` puts the configured activation back (then ~1e-7); its masks (padded
keys, the +-local_attention/2 window) and rotary positions are transformers'. mlx-embeddings' copies compute the
same (XLM-R to 7e-7 of mlx-vlm's, with manual softmax attention and a -10000 mask) and have the same GELU slip.
Maintenance: mlx-embeddings 0.1.0 imports mlx-vlm itself (its utils use mlx_vlm.utils) and adds
huggingface_hub; mlx-vlm, which the worker loads for vision anyway, ships the encoders beside its embedding and
reranker loaders; importing one encoder class pulls only transformers and PIL (1.6 s, once per such worker).
Speed, in-process on the shared 2-core CPU: the same within noise (XLM-R at multilingual-e5-small's shape, 4 x 128
tokens: 13.4 s mlx-vlm, 13.3 s mlx-embeddings; all-MiniLM-L6-v2, 8 x 128: 9.2 s bert.py, 9.5 s mlx-vlm, 9.4 s
mlx-embeddings). mlx-vlm's BertModel gives bert.py's hidden states bit for bit on all-MiniLM-L6-v2; bert.py stays
because BERT must load where mlx-vlm is absent (it is a --no-deps extra), and make-model builds BERT's and XLM-R's
weights with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from worker.mlx_engine.bert import load_bert

Encoder = Callable[[mx.array, mx.array], mx.array]  # (ids, attention mask) -> last hidden states

MLX_VLM_PACKAGES = {"xlm-roberta": "xlm_roberta", "modernbert": "modernbert"}  # model_type -> mlx_vlm.models.*
GELU = {"gelu": nn.GELU(), "gelu_new": nn.GELU(approx="precise"), "gelu_pytorch_tanh": nn.GELU(approx="precise")}


def load_encoder(config: dict, weights: dict[str, mx.array]) -> Encoder:
    """The encoder of config.json's `model_type` with `weights` (a safetensors dict under Hugging Face's names)."""
    model_type = config.get("model_type", "bert")
    if model_type == "bert":
        return load_bert(weights, config)
    package = MLX_VLM_PACKAGES.get(model_type)
    if package is None:
        raise ValueError(f"unsupported encoder model_type {model_type!r}: BERT, XLM-RoBERTa and ModernBERT are served")
    try:
        module = importlib.import_module(f"mlx_vlm.models.{package}")
    except ImportError as e:
        raise ValueError(f"{model_type} encoders run on mlx-vlm's classes, which this worker cannot import ({e}): "
                         "pip install --no-deps mlx-vlm") from None
    model = module.Model(module.ModelConfig.from_dict(config))
    if model_type == "modernbert":
        _exact_activation(model, config)
    elif config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported XLM-RoBERTa variant: hidden_act={config.get('hidden_act')!r}, "
                         f"position_embedding_type={config.get('position_embedding_type')!r}")
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    mx.eval(model.parameters())

    def hidden(ids: mx.array, mask: mx.array) -> mx.array:
        out: Any = model(ids, mask)
        return out.last_hidden_state  # its pooled text_embeds are never evaluated: MLX computes only what is used

    return hidden


def _exact_activation(model: nn.Module, config: dict) -> None:
    """The MLP activation config.json names (mlx-vlm hardcodes the tanh GELU; ModernBERT's configs say exact)."""
    act = config.get("hidden_activation", "gelu")
    if act not in GELU:
        raise ValueError(f"unsupported ModernBERT hidden_activation {act!r}")
    for layer in model.layers:
        layer.mlp.act = GELU[act]
