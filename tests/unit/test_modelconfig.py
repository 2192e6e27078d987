"""protocol/modelconfig.py: hostile configs and weights' headers refused naming the field; the memory estimate and the
published context read from a config (issue 48, item 2). No MLX: folders of a config.json and safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from protocol.modelconfig import (
    ESTIMATE_TOKENS,
    MAX_CONTEXT,
    ConfigError,
    check_model,
    context_length,
    memory_estimate,
    model_estimate,
    runtime_bytes_at,
    tensor_names,
    weight_layers,
)

# the tiny llama `mlxsup make-model` writes (tests.conftest.make_model)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 192,
        "max_position_embeddings": 8192, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "torch_dtype": "float32", "vocab_size": 1024}
LAYER = ("input_layernorm", "mlp.down_proj", "self_attn.q_proj")


def safetensors(path: Path, names: list[str]) -> None:
    """A safetensors file whose header lists `names` (one float32 each); the data is zeros."""
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    raw = json.dumps({"__metadata__": {"format": "mlx"}, **header}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4 * len(names))


def model(tmp_path: Path, layers: int = 2, prefix: str = "model.", **config: object) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **config}))
    names = [f"{prefix}layers.{i}.{p}.weight" for i in range(layers) for p in LAYER]
    safetensors(folder / "model.safetensors", [f"{prefix}embed_tokens.weight", *names, "lm_head.weight"])
    return folder


def test_the_tiny_models_config_and_weights_pass(tmp_path: Path) -> None:
    assert check_model(model(tmp_path))["num_hidden_layers"] == 2


# the configs of issue 48 (each failed late, or allocated without bound, or was published) and more of their kind
HOSTILE = [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000"),
    ({"hidden_size": -64}, "hidden_size is -64"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"vocab_size": 2**40}, "vocab_size is 1099511627776"),
    ({"max_position_embeddings": 2**62}, "max_position_embeddings is 4611686018427387904"),
    ({"num_key_value_heads": 3}, "num_key_value_heads is 3; it must divide num_attention_heads (4)"),
    ({"num_key_value_heads": 8}, "num_key_value_heads is 8"),
    ({"intermediate_size": [192, 0]}, "intermediate_size is [192, 0]"),
    ({"head_dim": "16"}, 'head_dim is "16"'),
    ({"head_dim": 16.0}, "head_dim is 16.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers is true"),
    ({"hidden_size": 2, "num_attention_heads": 4, "num_key_value_heads": 4}, "hidden_size is 2, less than"),
    ({"rope_theta": float("nan")}, "rope_theta is nan"),
    ({"rope_theta": -1}, "rope_theta is -1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor is 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": float("inf")}}, "rope_scaling.beta_fast is inf"),
    ({"rope_scaling": {"original_max_position_embeddings": -1}}, "rope_scaling.original_max_position_embeddings is -1"),
    ({"rope_scaling": "yarn"}, 'rope_scaling is "yarn"'),
    ({"rope_parameters": {"rope_theta": 0}}, "rope_parameters.rope_theta is 0"),
    ({"partial_rotary_factor": 2}, "partial_rotary_factor is 2"),
    ({"text_config": {"num_hidden_layers": 10**9}}, "text_config.num_hidden_layers is 1000000000"),
    ({"vision_config": {"num_hidden_layers": -1}}, "vision_config.num_hidden_layers is -1"),
    ({"text_config": [1]}, "text_config is [1]"),
    ({"num_local_experts": 10**9}, "num_local_experts is 1000000000"),
    ({"vision_config": {"depth": 10**9}}, "vision_config.depth is 1000000000"),  # a Qwen-VL vision tower's layers
    ({"vision_config": {"depth": 32}}, "vision_config.depth is 32 but the weights hold 2 layers"),
    # within the bounds, but the weights on disk hold 2 layers
    ({"num_hidden_layers": 64}, "num_hidden_layers is 64 but the weights hold 2 layers"),
    ({"text_config": {"num_hidden_layers": 3}}, "text_config.num_hidden_layers is 3 but the weights hold 2 layers"),
]


@pytest.mark.parametrize("change, says", HOSTILE, ids=[next(iter(c)) + "-" + str(i) for i, (c, _) in enumerate(HOSTILE)])
def test_a_hostile_config_is_refused_naming_its_field(tmp_path: Path, change: dict, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_model(model(tmp_path, **change))
    assert str(err.value).startswith("config.json: ") and says in str(err.value), err.value


def test_nulls_and_real_layouts_pass(tmp_path: Path) -> None:
    """What real configs hold: nulls, a nested text_config, rope parameters per layer type, LongRoPE's lists, mrope
    sections with zeros, expert counts of 0 in dense models, fewer layers claimed than the weights hold (MTP)."""
    check_model(model(tmp_path, layers=3, head_dim=None, rope_scaling=None, sliding_window=None, num_experts=0,
                      text_config={"num_hidden_layers": 3, "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                                                               "mrope_section": [1, 1, 0]}},
                      rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0],
                                       "truncate": False, "mscale_all_dim": 0, "attention_factor": None,
                                       "original_max_position_embeddings": None}))
    check_model(model(tmp_path, layers=2, prefix="language_model.model.", num_hidden_layers=1))


def test_weights_layers_read_from_every_shards_header(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    safetensors(folder / "model-00001-of-00002.safetensors", ["model.layers.0.mlp.weight", "encoder.layer.4.w"])
    safetensors(folder / "model-00002-of-00002.safetensors", ["vision_tower.blocks.9.attn.weight", "lm_head.weight"])
    assert weight_layers(tensor_names(folder)) == 10
    assert weight_layers(["lm_head.weight", "embed.weight"]) is None  # nothing named by layer: no cross-check


@pytest.mark.parametrize("raw, says", [
    (struct.pack("<Q", 2**62) + b"{}", "its header claims"),
    (b"\x01\x00", "its header claims"),
    (struct.pack("<Q", 3) + b"{{{", "cannot be read"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
])
def test_a_hostile_safetensors_header_is_refused_unread(tmp_path: Path, raw: bytes, says: str) -> None:
    folder = model(tmp_path)
    (folder / "model.safetensors").write_bytes(raw)
    with pytest.raises(ConfigError, match=says) as err:
        check_model(folder)
    assert str(err.value).startswith("model.safetensors: ")


@pytest.mark.parametrize("text, says", [("[1, 2]", "not a JSON object"), ("{", "cannot be read"),
                                         ("[" * 100_000, "cannot be read")])
def test_a_config_that_is_no_object_is_refused(tmp_path: Path, text: str, says: str) -> None:
    folder = model(tmp_path)
    (folder / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=says):
        check_model(folder)


def test_the_published_context_is_capped() -> None:
    assert context_length(TINY) == 8192
    assert context_length({**TINY, "max_position_embeddings": 2**30}) == MAX_CONTEXT == 2**24
    assert context_length({**TINY, "max_position_embeddings": 2**62}) == MAX_CONTEXT
    assert context_length({"text_config": {"max_position_embeddings": 2**62}}) == MAX_CONTEXT
    assert context_length({**TINY, "max_position_embeddings": "lots"}) == context_length({}) == 4096


def test_the_memory_estimate_is_the_kv_of_its_attention_layers_and_one_chunks_logits(tmp_path: Path) -> None:
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim (64 / 4) x float32
    estimate = memory_estimate(TINY)
    assert estimate.kv_bytes_per_token == per_token
    assert estimate.runtime_bytes == per_token * ESTIMATE_TOKENS + 1024 * ESTIMATE_TOKENS * 4
    assert estimate.kv_tokens == ESTIMATE_TOKENS
    # the same first request with its K/V at 8 bits in groups of 16 (a float32 scale and bias each): issue 53
    eight = runtime_bytes_at(estimate.runtime_bytes, per_token, estimate.kv_tokens, 4, 8, 16)
    assert eight == (per_token // 4 + per_token // 4 // 16 * 2 * 4) * ESTIMATE_TOKENS + 1024 * ESTIMATE_TOKENS * 4
    assert runtime_bytes_at(estimate.runtime_bytes, per_token, estimate.kv_tokens, 4, None) == estimate.runtime_bytes
    bf16 = memory_estimate({**TINY, "torch_dtype": "bfloat16", "head_dim": 32, "num_hidden_layers": 4,
                            "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert bf16.kv_bytes_per_token == 1 * 2 * 2 * 32 * 2  # one full-attention layer's
    short = memory_estimate({**TINY, "max_position_embeddings": 512})
    assert short.runtime_bytes == per_token * 512 + 1024 * 512 * 4  # a context shorter than the estimate's tokens
    assert short.kv_tokens == 512
    assert memory_estimate({}) == memory_estimate({"num_hidden_layers": "x", "hidden_size": -1}) == model_estimate(
        tmp_path / "none")
    assert memory_estimate({}).runtime_bytes == 0
    huge = memory_estimate({**TINY, "num_hidden_layers": 10**9, "num_key_value_heads": 10**9, "vocab_size": 2**40})
    assert huge.kv_bytes_per_token <= 2**12 * 2 * 2**12 * 2**12 * 4  # bounded by the limits, never 10^18
    # a folder's estimate: a config its worker refuses counts nothing (its load fails naming the field, not a 507)
    assert model_estimate(model(tmp_path)) == estimate
    assert model_estimate(model(tmp_path, num_hidden_layers=10**9)) == model_estimate(
        model(tmp_path, text_config={"vocab_size": -1})) == memory_estimate({})
