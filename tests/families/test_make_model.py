"""Each family's tiny model as mlx-lm sees it: real model classes, real cache types, real tokens, real templates.

Real MLX on the CPU, in process: `mlx_lm.load` builds the family's own layers and caches from the
written config, reads the weights without re-mapping them, generates greedily, stops on the
family's EOS tokens; quantized variants run the quantized kernels on the same weights; the chat
templates render system prompts, tools, tool calls, tool results and the reasoning switches in
each family's published format.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from tests.conftest import MLXSUP
from tests.families.conftest import BY_NAME, MODELS
from worker.template_input import special_token_ids

KV, ROT, ARR = "KVCache", "RotatingKVCache", "ArraysCache"
CACHES = {
    "llama": [KV, KV], "qwen3": [KV, KV], "qwen3_moe": [KV, KV],
    "gemma3": [ROT] * 5 + [KV],  # every 6th layer global
    "gpt_oss": [ROT, KV],  # sliding, full, ...
    "qwen3_5": [ARR] * 3 + [KV],  # a full-attention layer every 4th
}
MODEL_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
               "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
               "gpt_oss": ("gpt_oss", "GptOssForCausalLM"), "qwen3_5": ("qwen3_5", "Qwen3_5ForConditionalGeneration")}
EOS = {"llama": {"<|im_end|>"}, "qwen3": {"<|im_end|>", "<|endoftext|>"}, "qwen3_moe": {"<|im_end|>", "<|endoftext|>"},
       "gemma3": {"<eos>", "<end_of_turn>"}, "gpt_oss": {"<|return|>", "<|endoftext|>", "<|call|>"},
       "qwen3_5": {"<|im_end|>", "<|endoftext|>"}}
CHAT = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Name a color."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}}}}


def tool_conversation(arguments: object) -> list[dict]:
    """System prompt, a question, the assistant's reasoning and tool call, the tool's result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def loaded(family_models: Path, name: str) -> tuple:
    return load(str(family_models / name))


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_loads_the_family_layers_caches_and_weights_unchanged(family_models: Path, name: str) -> None:
    made = BY_NAME[name]
    path = family_models / name
    model, tok = loaded(family_models, name)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["architectures"][0]) == MODEL_TYPES[made.arch]
    assert type(model).__module__ == f"mlx_lm.models.{made.arch if made.arch != 'gemma3' else 'gemma3_text'}"
    caches = make_prompt_cache(model)
    assert [type(c).__name__ for c in caches] == CACHES[made.arch]
    window = config.get("sliding_window")
    assert all(c.max_size == window for c in caches if type(c).__name__ == ROT)
    # what is on disk is what the model holds: loading did not re-map (sanitize) or drop anything
    saved = mx.load(str(path / "model.safetensors"))
    held = dict(tree_flatten(model.parameters()))
    assert sorted(saved) == sorted(held)
    assert all(mx.array_equal(saved[k], held[k]).item() for k in saved)
    assert (config.get("tie_word_embeddings", True) is False) == ("lm_head.weight" in saved or
                                                                  "language_model.lm_head.weight" in saved)


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_generates_greedily_and_stops_on_the_family_eos(family_models: Path, name: str) -> None:
    made = BY_NAME[name]
    model, tok = loaded(family_models, name)
    assert {tok.convert_ids_to_tokens(i) for i in tok.eos_token_ids} == EOS[made.arch]
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    first = generate(model, tok, prompt, max_tokens=8)
    assert first and first == generate(model, tok, prompt, max_tokens=8)


@pytest.mark.parametrize("name", ["qwen3-4bit", "qwen3_5-4bit", "gpt_oss-4bit"])
def test_quantized_variants_hold_the_same_weights_in_quantized_layers(family_models: Path, name: str) -> None:
    """Affine, group size 64, as mlx-lm converts: every linear layer (experts and embedding included) is
    quantized and dequantizes back to the unquantized model's weights (same seed); gpt-oss's router keeps 8 bits."""
    made = BY_NAME[name]
    config = json.loads((family_models / name / "config.json").read_text())
    assert {k: config["quantization"][k] for k in ("group_size", "bits", "mode")} == \
        {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    quantized, _ = loaded(family_models, name)
    plain = dict(tree_flatten(loaded(family_models, made.arch)[0].parameters()))
    layers = {path: m for path, m in quantized.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))}
    plain_layers = {k.rsplit(".", 1)[0] for k in plain if k.endswith("weight") and plain[k].ndim >= 2
                    and "conv1d" not in k}
    assert set(layers) == plain_layers, "some linear layer was left unquantized"
    for path, layer in layers.items():
        weight = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        original = plain[path + ".weight"]
        error = (mx.linalg.norm(weight - original) / mx.linalg.norm(original)).item()
        assert error < (0.02 if layer.bits == 8 else 0.15), f"{path}: {layer.bits}-bit error {error:.3f}"
        expected_bits = 8 if made.arch == "gpt_oss" and path.endswith("router") else 4
        assert (layer.group_size, layer.bits) == (64, expected_bits), path


@pytest.mark.parametrize("name", ["qwen3", "qwen3-4bit", "qwen3_5", "qwen3_5-4bit", "gpt_oss-4bit"])
def test_admission_estimates_a_model_by_what_its_weights_take_loaded(family_models: Path, name: str) -> None:
    """The supervisor admits a model by its safetensors' bytes on disk (supervisor/registry.py); loaded, quantized
    weights stay packed, so that is what they take in memory (a float16 estimate would be ~4x a 4-bit model)."""
    from supervisor.registry import weights_bytes

    model, _ = loaded(family_models, name)
    in_memory = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    on_disk = weights_bytes(family_models / name)
    assert in_memory <= on_disk < in_memory * 1.05 + 64 * 1024  # + the safetensors headers
    if name.endswith("-4bit"):
        plain = sum(v.nbytes for _, v in tree_flatten(loaded(family_models, BY_NAME[name].arch)[0].parameters()))
        assert on_disk < plain / 2.5


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt_oss", "qwen3_5"])
def test_control_tokens_are_special_and_format_text_is_not(family_models: Path, arch: str) -> None:
    from worker.mlx_engine.make_model import FAMILIES

    _, tok = loaded(family_models, arch)
    spec = FAMILIES[arch].tokens
    special = {tok.convert_ids_to_tokens(i) for i in special_token_ids(tok)}
    assert set(spec.control) <= special
    assert not set(spec.text) & special
    think = tok.encode("<think>", add_special_tokens=False)
    assert (len(think) == 1) == ("<think>" in spec.text)  # one added token, or plain text in BPE pieces


@pytest.mark.parametrize("arch", list(CACHES))
def test_the_loaded_tokenizer_encodes_as_tokenizer_json_says(family_models: Path, arch: str) -> None:
    """transformers picks its own tokenizer class for some model types (qwen3_5): it must still encode
    as the trained BPE in tokenizer.json does, and decode back to the text."""
    from tokenizers import Tokenizer

    _, tok = loaded(family_models, arch)
    text = "Héllo wörld 12345 it's  DONE!!\n\n  日本語 😀 def f(x):\n\treturn x+1 <think>a</think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == Tokenizer.from_file(str(family_models / arch / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_qwen3_template_tools_tool_call_tool_result_and_thinking_switch(family_models: Path) -> None:
    _, tok = loaded(family_models, "qwen3")
    conversation = tool_conversation('{"city": "Paris"}')  # OpenAI's wire format: arguments as a JSON string
    text = tok.apply_chat_template(conversation, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL) + "\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")  # mlx-lm turns thinking on: the model opens its own <think>
    off = tok.apply_chat_template(conversation, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert off == text + "<think>\n\n</think>\n\n"
    # a finished exchange drops the reasoning of turns before the last question
    history = [*CHAT, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nBlue."},
               {"role": "user", "content": "Another?"}]
    rendered = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant\nBlue.<|im_end|>\n<|im_start|>user\nAnother?" in rendered
    assert tok.tool_parser is not None and tok.tool_parser.__module__.endswith("json_tools")


def test_qwen3_5_template_xml_tool_calls_and_thinking_by_default(family_models: Path) -> None:
    _, tok = loaded(family_models, "qwen3_5")
    conversation = tool_conversation({"city": "Paris", "days": 2})  # Hugging Face's convention: a mapping
    text = tok.apply_chat_template(conversation, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    head = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    assert text.startswith(head + json.dumps(WEATHER_TOOL) + "\n</tools>\n\nIf you choose to call a function")
    assert "</IMPORTANT>\n\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    off = tok.apply_chat_template(conversation, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert off == text.removesuffix("<think>\n") + "<think>\n\n</think>\n\n"
    assert tok.tool_parser is not None and tok.tool_parser.__module__.endswith("qwen3_coder")


def test_gemma3_template_turns(family_models: Path) -> None:
    _, tok = loaded(family_models, "gemma3")
    history = [*CHAT, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": " Another? "}]
    text = tok.apply_chat_template(history, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nYou answer in one line.\n\nName a color.<end_of_turn>\n"
                    "<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tok.apply_chat_template(history, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # one <bos>, from the template
    assert tok.encode("hi")[0] == tok.bos_token_id  # a plain prompt gets it from the tokenizer
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tokenize=False)


def test_gpt_oss_template_is_harmony(family_models: Path) -> None:
    """Checked against the format OpenAI publishes (openai-harmony itself needs its vocabulary from the network)."""
    _, tok = loaded(family_models, "gpt_oss")
    days = {datetime.now().strftime("%Y-%m-%d")}
    text = tok.apply_chat_template(tool_conversation({"city": "Paris"}), tools=[WEATHER_TOOL],
                                   add_generation_prompt=True, tokenize=False)
    days.add(datetime.now().strftime("%Y-%m-%d"))
    system = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
              "Knowledge cutoff: 2024-06\nCurrent date: {day}\n\nReasoning: medium\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
              "Calls to these tools must go to the commentary channel: 'functions'.<|end|>")
    rest = ("<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n# Tools\n\n## functions\n\n"
            "namespace functions {\n\n// Gets the current weather in a city.\ntype get_weather = (_: {\n"
            "// The city, e.g. Paris\ncity: string,\nunit?: \"celsius\" | \"fahrenheit\", // default: celsius\n"
            "}) => any;\n\n} // namespace functions<|end|>"
            "<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            "{\"city\": \"Paris\"}<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 21}<|end|>"
            "<|start|>assistant")
    assert text in {system.format(day=day) + rest for day in days}
    # once answered, the reasoning goes; a final answer in the history ends <|end|>, in training <|return|>
    answered = [*tool_conversation({"city": "Paris"}), {"role": "assistant", "content": "21 degrees."}]
    history = tok.apply_chat_template([*answered, {"role": "user", "content": "Thanks"}], tools=[WEATHER_TOOL],
                                      add_generation_prompt=True, tokenize=False, reasoning_effort="high")
    assert "Reasoning: high" in history and "<|channel|>analysis" not in history
    assert history.endswith("<|channel|>final<|message|>21 degrees.<|end|><|start|>user<|message|>Thanks<|end|>"
                            "<|start|>assistant")
    training = tok.apply_chat_template(answered, tools=[WEATHER_TOOL], tokenize=False)
    assert training.endswith("<|start|>assistant<|channel|>final<|message|>21 degrees.<|return|>")


def test_make_model_command_line(tmp_path: Path) -> None:
    out = tmp_path / "m"
    run = subprocess.run([*MLXSUP, "make-model", str(out), "--arch", "qwen3_5", "--quantize", "8", "--seed", "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote qwen3_5 tiny model" in run.stdout and "8-bit" in run.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["text_config"]["layer_types"][3] == "full_attention"
    assert (out / "chat_template.jinja").exists() and (out / "generation_config.json").exists()
    again = subprocess.run([*MLXSUP, "make-model", str(out), "--arch", "qwen3"], capture_output=True, text=True)
    assert again.returncode == 2 and "already holds a model" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(tmp_path / "x"), "--arch", "mamba"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
