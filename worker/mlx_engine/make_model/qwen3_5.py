"""Qwen3.5, the hybrid family: Gated DeltaNet linear-attention layers with a full-attention layer every few.

The linear layers keep a convolution window and a recurrent state in an `ArraysCache` (size 2)
instead of keys and values; every `full_attention_interval`-th layer is gated full attention with a
`KVCache` and partial rotary embeddings. The config is laid out as mlx-lm's converter leaves a
Qwen3.5 checkpoint: `model_type: qwen3_5` with the language model under `text_config`
(`model_type: qwen3_5_text`, `layer_types`, `full_attention_interval`, `linear_num_key_heads`,
`linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`,
`rope_parameters`) and no vision tower (text only). Weights sit under `language_model.`; `A_log`
stays float32 (the model's cast_predicate). EOS: `<|im_end|>` and `<|endoftext|>` in
generation_config.json (config.json's text_config names `<|endoftext|>`, as Qwen's does).
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.mlx_engine.make_model.chatml import QWEN3_5_TEMPLATE, QWEN_CONTROL_TOKENS, QWEN_TEXT_TOKENS
from worker.mlx_engine.make_model.family import (
    QWEN3_5_SPLIT,
    Family,
    TokenIds,
    TokenSpec,
    dtype_of,
    ids_of,
    shape_fields,
)

TOKENS = TokenSpec(
    control=QWEN_CONTROL_TOKENS, text=QWEN_TEXT_TOKENS,
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>"),
    split_regex=QWEN3_5_SPLIT, tokenizer_extra={"errors": "replace", "split_special_tokens": False},
)

_LINEAR = dict(linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144, tie=True)
PRESETS: dict[str, dict] = {
    # 3 linear-attention layers and 1 full-attention layer; head sizes of 32 take the Metal kernel on a Mac.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                 intermediate_size=128, vocab=1024, dtype="float32", **_LINEAR),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                  intermediate_size=2048, vocab=4096, dtype="float32", **_LINEAR),
    # Qwen3.5's head shapes (256-wide gated attention heads, 128-wide linear heads): ~1.0B parameters.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, intermediate_size=6912, vocab=8192, dtype="bfloat16", **_LINEAR),
}


def layer_types(n_layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]


def mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """Qwen's [11, 11, 10] split of the rotary frequencies (t, h, w), scaled to this head size."""
    n = int(head_dim * partial_rotary_factor) // 2
    side = round(n * 11 / 32)
    return [side, side, n - 2 * side]


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    text_config = {
        "model_type": "qwen3_5_text",
        **shape_fields(dims),
        "hidden_act": "silu",
        "attention_bias": False,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": dims["linear_conv_kernel_dim"],
        "linear_num_key_heads": dims["linear_num_key_heads"],
        "linear_num_value_heads": dims["linear_num_value_heads"],
        "linear_key_head_dim": dims["linear_key_head_dim"],
        "linear_value_head_dim": dims["linear_value_head_dim"],
        "full_attention_interval": dims["full_attention_interval"],
        "layer_types": layer_types(dims["num_hidden_layers"], dims["full_attention_interval"]),
        "max_position_embeddings": dims["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": mrope_section(dims["head_dim"], 0.25)},
        "vocab_size": vocab_size,
        "tie_word_embeddings": dims["tie"],
        "eos_token_id": ids["<|endoftext|>"],
        "mlp_only_layers": [],
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype_of(dims),
    }
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "tie_word_embeddings": dims["tie"],
    }


def generation_config(ids: TokenIds) -> dict:
    return {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids_of(ids, TOKENS.stop), "do_sample": True, "temperature": 0.6, "top_k": 20,
            "top_p": 0.95}


QWEN3_5 = Family(arch="qwen3_5", description="Qwen3.5 hybrid: Gated DeltaNet layers (ArraysCache) + full attention "
                                             "every 4th layer (KVCache)",
                 presets=PRESETS, tokens=TOKENS, chat_template=QWEN3_5_TEMPLATE, configure=configure,
                 generation_config=generation_config, template_file=True)
