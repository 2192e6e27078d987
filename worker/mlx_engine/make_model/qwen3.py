"""Qwen3 (dense) and Qwen3-MoE: KVCache layers with q/k norms; the MoE routes each token to top-k of its experts.

Configs follow Qwen's repos (Qwen3-1.7B, Qwen3-30B-A3B): `head_dim` apart from hidden/heads, tied
embeddings on the small dense models, `num_experts` / `num_experts_per_tok` / `moe_intermediate_size`
/ `decoder_sparse_step` / `mlp_only_layers` / `norm_topk_prob` on the MoE. Experts are stored
stacked (`mlp.switch_mlp.*`), as mlx-lm's converter leaves them. config.json names `<|im_end|>` as
EOS; generation_config.json lists `<|im_end|>` and `<|endoftext|>`, as Qwen ships them.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.mlx_engine.make_model.chatml import QWEN3_TEMPLATE, QWEN_CONTROL_TOKENS, QWEN_TEXT_TOKENS
from worker.mlx_engine.make_model.family import QWEN2_SPLIT, Family, TokenIds, TokenSpec, dtype_of, ids_of, shape_fields

TOKENS = TokenSpec(
    control=QWEN_CONTROL_TOKENS, text=QWEN_TEXT_TOKENS,
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>"),
    split_regex=QWEN2_SPLIT, tokenizer_extra={"errors": "replace", "split_special_tokens": False},
)

DENSE_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab=1024, max_position_embeddings=40960, tie=True, dtype="float32"),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                  intermediate_size=2048, vocab=4096, max_position_embeddings=40960, tie=True, dtype="float32"),
    # Qwen3-1.7B's layer shape, fewer layers: ~1.0B parameters.
    "1b": dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               intermediate_size=6144, vocab=8192, max_position_embeddings=40960, tie=True, dtype="bfloat16"),
}

MOE_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                 vocab=1024, max_position_embeddings=40960, tie=False, dtype="float32"),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1536, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                  vocab=4096, max_position_embeddings=40960, tie=False, dtype="float32"),
    # Qwen3-30B-A3B's attention and expert shapes at a quarter of the experts and layers: ~1.0B in total.
    "1b": dict(hidden_size=1024, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
               vocab=8192, max_position_embeddings=40960, tie=False, dtype="bfloat16"),
}


def _common(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        **shape_fields(dims),
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": dims["max_position_embeddings"],
        "max_window_layers": dims["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": dims["tie"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_of(dims),
    }


def configure_dense(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_common(dims, ids, vocab_size)}


def configure_moe(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_common(dims, ids, vocab_size),
        "num_experts": dims["num_experts"],
        "num_experts_per_tok": dims["num_experts_per_tok"],
        "moe_intermediate_size": dims["moe_intermediate_size"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def generation_config(ids: TokenIds) -> dict:
    return {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids_of(ids, TOKENS.stop), "do_sample": True, "temperature": 0.6, "top_k": 20,
            "top_p": 0.95}


QWEN3 = Family(arch="qwen3", description="Qwen3 dense: KVCache layers, q/k norms, tied embeddings",
               presets=DENSE_PRESETS, tokens=TOKENS, chat_template=QWEN3_TEMPLATE, configure=configure_dense,
               generation_config=generation_config)
QWEN3_MOE = Family(arch="qwen3_moe", description="Qwen3-MoE: KVCache layers, top-k routed experts (SwitchGLU)",
                   presets=MOE_PRESETS, tokens=TOKENS, chat_template=QWEN3_TEMPLATE, configure=configure_moe,
                   generation_config=generation_config)
