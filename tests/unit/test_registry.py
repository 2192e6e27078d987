"""Model discovery and resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import ConfigError, Settings, load_file
from supervisor.errors import ModelNotFound
from supervisor.registry import Registry, discover


def fake_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 10)
    return path


def test_discovery_needs_config_and_weights(tmp_path: Path) -> None:
    fake_model(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    specs = discover(tmp_path)
    assert [s.id for s in specs] == ["a"] and specs[0].weights_bytes == 10


def test_config_models_aliases_and_unknown_names(tmp_path: Path) -> None:
    fake_model(tmp_path / "models" / "a")
    fake_model(tmp_path / "elsewhere")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[models.big]\npath = "elsewhere"\naliases = ["b", "large"]\n')
    settings = load_file(cfg, Settings())
    reg = Registry.build([tmp_path / "models"], settings.models)
    assert reg.ids() == ["a", "big"]
    assert reg.resolve("large").id == "big" and reg.resolve("a").id == "a"
    with pytest.raises(ModelNotFound) as err:
        reg.resolve("c")
    assert "a, big" in err.value.message and err.value.status == 404
    assert "Anthropic and Responses APIs" in err.value.message  # why Claude's names are served and gpt-4o is not


@pytest.mark.parametrize("text, match", [
    ("[server]\nport = 'x'\n", "server.port"),
    ("[server]\nwat = 1\n", "server.wat"),
    ("[models.m]\npath = 'nowhere'\n", "models.m.path"),
    ("[mystery]\n", "unknown section"),
    ("not toml = = 1", "config.toml"),
])
def test_bad_config_is_rejected_with_the_key(tmp_path: Path, text: str, match: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_file(cfg, Settings())


def test_a_generating_models_memory_past_its_weights_is_read_from_its_config(tmp_path: Path) -> None:
    """Admission's estimate (issue 48): a chat model's KV per token and first request's bytes, from its config.json;
    none for an embedding model, or a config that says too little; the same for a model the config file names."""
    import json

    from protocol.modelconfig import memory_estimate

    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1024, "max_position_embeddings": 8192, "torch_dtype": "float32"}
    fake_model(tmp_path / "models" / "chat")
    (tmp_path / "models" / "chat" / "config.json").write_text(json.dumps(config))
    fake_model(tmp_path / "models" / "embed")
    (tmp_path / "models" / "embed" / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    fake_model(tmp_path / "models" / "bare")
    specs = {s.id: s for s in discover(tmp_path / "models")}
    expected = memory_estimate(config)
    assert (specs["chat"].kv_bytes_per_token, specs["chat"].runtime_bytes) == (512, expected.runtime_bytes)
    assert expected.runtime_bytes > 0
    assert (specs["embed"].kv_bytes_per_token, specs["embed"].runtime_bytes) == (0, 0)
    assert (specs["bare"].kv_bytes_per_token, specs["bare"].runtime_bytes) == (0, 0)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[models.named]\npath = "{tmp_path / "models" / "chat"}"\n')
    [named] = load_file(cfg, Settings()).models
    assert (named.kv_bytes_per_token, named.runtime_bytes) == (512, expected.runtime_bytes)
