"""A BERT encoder in MLX, reading Hugging Face's BertModel weights as they are (no conversion).

Why our own and not mlx-embeddings: its 0.1.0 imports mlx-vlm at package import, which brings datasets,
pyarrow, pandas, opencv, scipy and mlx-audio into every embedding worker; the encoder itself is this page.
Post-LayerNorm blocks, exact (erf) GELU, absolute positions, one token type: what BertModel computes in
eval mode. Invariant: padded positions never change a real token's output (the attention mask is additive
-inf on padded keys), so a sequence's hidden states do not depend on what it was batched with beyond float
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_dict(cls, config: dict) -> BertConfig:
        act = config.get("hidden_act", "gelu")
        if act != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported BERT variant: hidden_act={act!r}, "
                             f"position_embedding_type={config.get('position_embedding_type')!r}")
        return cls(config["vocab_size"], config["hidden_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], config["intermediate_size"], config["max_position_embeddings"],
                   config.get("type_vocab_size", 2), config.get("layer_norm_eps", 1e-12))


class Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None]
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class DenseNorm(nn.Module):
    """A projection, then LayerNorm of it plus the residual (BERT's 'output' blocks)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(c)  # the weights' name: attention.self.query
        self.output = DenseNorm(c.hidden_size, c.hidden_size, c.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        sa: SelfAttention = self.self
        b, n, d = x.shape
        h = sa.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(sa.query(x)), split(sa.key(x)), split(sa.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=(d // h) ** -0.5, mask=mask)
        return self.output(out.transpose(0, 2, 1, 3).reshape(b, n, d), x)


class Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return nn.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseNorm(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = [Layer(c) for _ in range(c.num_hidden_layers)]


class BertModel(nn.Module):
    """Token ids [batch, n] and a 0/1 attention mask [batch, n] -> last hidden states [batch, n, hidden]."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)

    def __call__(self, ids: mx.array, attention_mask: mx.array) -> mx.array:
        x = self.embeddings(ids)
        # additive, broadcast over heads and queries: a padded key gets no weight from any query
        mask = mx.where(attention_mask[:, None, None, :].astype(mx.bool_), 0.0, -mx.inf).astype(x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def load_bert(weights: dict[str, mx.array], config: dict) -> BertModel:
    """A BertModel with `weights` (a safetensors dict; a `bert.` prefix, the pooler and position_ids dropped)."""
    model = BertModel(BertConfig.from_dict(config))
    kept = {}
    for name, value in weights.items():
        name = name.removeprefix("bert.")
        if name.startswith(("embeddings.", "encoder.")) and not name.endswith("position_ids"):
            kept[name] = value
    model.load_weights(list(kept.items()), strict=True)
    mx.eval(model.parameters())
    return model
