"""Gemma 3 (text): sliding-window layers (RotatingKVCache) with a global-attention layer every few (KVCache).

mlx-lm's `gemma3_text` model type, configured as Google's gemma-3-1b repo is: `sliding_window`,
`sliding_window_pattern` (every 6th layer global; `layer_types` says the same for newer readers),
`query_pre_attn_scalar`, `rope_local_base_freq`, one KV head, tied embeddings (no `lm_head` in the
checkpoint). The tiny preset's window is 32 tokens so that short test prompts already wrap it.

The chat format is Gemma's turns: `<start_of_turn>user\\n ... <end_of_turn>\\n`, the assistant's role
named `model`, a system prompt folded into the first user turn, roles strictly alternating, and
`<bos>` opening the conversation. Gemma 3's template has no tool section: tools are ignored.
EOS: `<eos>` and `<end_of_turn>` in config.json and generation_config.json.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec, dtype_of, ids_of, shape_fields

TOKENS = TokenSpec(
    control=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
             "<end_of_image>", "<image_soft_token>"),
    bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", stop=("<eos>", "<end_of_turn>"), add_bos=True,
    tokenizer_extra={"spaces_between_special_tokens": False},
)

CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- if messages[0].content is string %}
        {%- set first_user_prefix = messages[0].content + '\n\n' %}
    {%- else %}
        {%- set first_user_prefix = messages[0].content[0].text + '\n\n' %}
    {%- endif %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set role = 'model' if message.role == 'assistant' else message.role %}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {%- if message.content is string %}
        {{- message.content | trim }}
    {%- elif message.content is iterable %}
        {%- for item in message.content %}
            {%- if item.type == 'image' %}
                {{- '<start_of_image>' }}
            {%- elif item.type == 'text' %}
                {{- item.text | trim }}
            {%- endif %}
        {%- endfor %}
    {%- else %}
        {{- raise_exception('Invalid content type') }}
    {%- endif %}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""

_COMMON = dict(num_attention_heads=4, num_key_value_heads=1, sliding_window_pattern=6, max_position_embeddings=32768)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=6, head_dim=16, intermediate_size=128, sliding_window=32,
                 vocab=1024, dtype="float32", **_COMMON),
    "small": dict(hidden_size=640, num_hidden_layers=12, head_dim=256, intermediate_size=2048, sliding_window=512,
                  vocab=4096, dtype="float32", **_COMMON),
    # gemma-3-1b's layer shape, deeper to make up for its 262k-token embedding: ~1.0B parameters.
    "1b": dict(hidden_size=1152, num_hidden_layers=36, head_dim=256, intermediate_size=6912, sliding_window=512,
               vocab=8192, dtype="bfloat16", **_COMMON),
}


def configure(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    pattern = dims["sliding_window_pattern"]
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **shape_fields(dims),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": dims["head_dim"],
        "sliding_window": dims["sliding_window"],
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                        for i in range(dims["num_hidden_layers"])],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": dims["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids_of(ids, TOKENS.stop),
        "pad_token_id": ids["<pad>"],
        "cache_implementation": "hybrid",
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_of(dims),
    }


def generation_config(ids: TokenIds) -> dict:
    return {"bos_token_id": ids["<bos>"], "pad_token_id": ids["<pad>"], "eos_token_id": ids_of(ids, TOKENS.stop),
            "cache_implementation": "hybrid", "do_sample": True, "top_k": 64, "top_p": 0.95}


GEMMA3 = Family(arch="gemma3", description="Gemma 3 text: sliding-window layers (RotatingKVCache) + a global "
                                           "layer every 6th (KVCache)",
                presets=PRESETS, tokens=TOKENS, chat_template=CHAT_TEMPLATE, configure=configure,
                generation_config=generation_config, tools=False)
