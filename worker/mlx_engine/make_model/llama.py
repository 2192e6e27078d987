"""The Llama family: plain KVCache layers, the project's first test and benchmark model.

Its tokens and its minimal ChatML template are the project's own (the model maker's first
format), kept as they were so earlier results stay comparable.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec, dtype_of

PRESETS: dict[str, dict] = {
    # A few MB: loads in well under a second, for tests and the demo.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab=1024, max_position_embeddings=8192, dtype="float32"),
    # ~100M parameters: compute dominates on a CPU.
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab=4096, max_position_embeddings=8192, dtype="float32"),
    # ~1B parameters in bf16: the GPU benchmark preset.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab=8192, max_position_embeddings=8192, dtype="bfloat16"),
}

TOKENS = TokenSpec(
    control=("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"),
    bos="<|bos|>", eos="<|im_end|>", pad="<|pad|>", stop=("<|im_end|>",),
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": dims["hidden_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "intermediate_size": dims["intermediate_size"],
        "vocab_size": vocab_size,
        "max_position_embeddings": dims["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|bos|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": dtype_of(dims),
    }


FAMILY = Family(arch="llama", description="Llama: plain KVCache layers (the project's original test model)",
                presets=PRESETS, tokens=TOKENS, chat_template=CHAT_TEMPLATE, configure=configure, tools=False)
