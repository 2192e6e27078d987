"""gpt-oss: alternating sliding-window (RotatingKVCache) and full-attention (KVCache) layers, attention sinks, MoE.

Configured as OpenAI's gpt-oss-20b repo is: `layer_types` alternating `sliding_attention` /
`full_attention`, `sliding_window`, `num_local_experts` / `num_experts_per_tok` (and the older
`experts_per_token`), biased attention projections, `swiglu_limit`, YaRN rope scaling from a 4096-token
original context, untied `lm_head`. Experts are stored split and stacked (`mlp.experts.gate_proj`,
`up_proj`, `down_proj` with biases), as mlx-lm's sanitize() leaves them; quantized, the router
keeps 8 bits (the model's quant_predicate). The tiny preset's window is 32 tokens so that short
test prompts already wrap it.

The chat format is harmony (harmony.py). EOS: config.json names `<|return|>`;
generation_config.json lists `<|return|>`, `<|endoftext|>` and `<|call|>`, as OpenAI ships them.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec, dtype_of, ids_of
from worker.mlx_engine.make_model.harmony import HARMONY_TEMPLATE

TOKENS = TokenSpec(
    control=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
             "<|message|>", "<|call|>", "<|endofprompt|>"),
    bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", stop=("<|return|>", "<|endoftext|>", "<|call|>"),
    tokenizer_extra={"model_input_names": ["input_ids", "attention_mask"]},
)

_COMMON = dict(max_position_embeddings=131072, initial_context_length=4096)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=32, vocab=1024,
                 dtype="float32", **_COMMON),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, sliding_window=128, vocab=4096,
                  dtype="float32", **_COMMON),
    # gpt-oss-20b's attention and routing (64-wide heads, top-4) at a smaller width: ~1.0B in total.
    "1b": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               intermediate_size=1024, num_local_experts=20, num_experts_per_tok=4, sliding_window=128, vocab=8192,
               dtype="bfloat16", **_COMMON),
}


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    n_layers = dims["num_hidden_layers"]
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": dims["hidden_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"],
        "intermediate_size": dims["intermediate_size"],
        "num_local_experts": dims["num_local_experts"],
        "num_experts_per_tok": dims["num_experts_per_tok"],
        "experts_per_token": dims["num_experts_per_tok"],
        "sliding_window": dims["sliding_window"],
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": dims["initial_context_length"], "truncate": False},
        "initial_context_length": dims["initial_context_length"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|return|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.9,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_of(dims),
    }


def generation_config(ids: TokenIds) -> dict:
    return {"bos_token_id": ids["<|startoftext|>"], "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids_of(ids, TOKENS.stop), "do_sample": True}


GPT_OSS = Family(arch="gpt_oss", description="gpt-oss: alternating sliding-window (RotatingKVCache) and full "
                                             "(KVCache) layers, attention sinks, MoE; harmony chat format",
                 presets=PRESETS, tokens=TOKENS, chat_template=HARMONY_TEMPLATE, configure=configure,
                 generation_config=generation_config, template_file=True)
