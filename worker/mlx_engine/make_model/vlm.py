"""Vision-language families for make-model: Qwen3-VL and Gemma 3 with its SigLIP tower, loadable by `mlx_vlm.load(DIR)`.

Each writes what the real repos ship, in their layout: config.json with `text_config` and `vision_config` (Qwen's
`qwen3_vl` with `image_token_id` / `vision_start_token_id`, Google's `gemma3` with `image_token_index` /
`mm_tokens_per_image`), preprocessor_config.json and processor_config.json (so mlx-vlm's torch-free processors run
offline), and a chat template that writes an image part as the family's placeholder (`<|vision_start|><|image_pad|>
<|vision_end|>`; `<start_of_image>`), which the processor expands to the image's tokens. The tokenizer is the text
family's (make_model/tokenizer.py), with Gemma's image tokens named in tokenizer_config.json's
`extra_special_tokens` as Google's is, so the processor finds them.

The weights are built by mlx-vlm's own model class from that config.json (its initialisers: random) and saved in
mlx-vlm's layout, so `mlx_vlm.load` maps nothing. Invariant, as for the text families (weights.py): every sanitize
step `mlx_vlm.load` runs hands each array back unchanged under its name, checked before anything is written.
The tiny presets see a 64x64 image as a handful of tokens (Qwen: 4 after the 2x2 merge; Gemma: 4 pooled).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model import gemma3, qwen3
from worker.mlx_engine.make_model.chatml import _MESSAGE_LOOP_HEAD, QWEN3_TEMPLATE
from worker.mlx_engine.make_model.family import Family, TokenIds, TokenSpec, ids_of
from worker.mlx_engine.make_model.qwen3_5 import mrope_section
from worker.mlx_engine.make_model.weights import tied_embeddings

if TYPE_CHECKING:
    import mlx.nn as nn

# Qwen3-VL's content: a string, or parts (an image part as the vision placeholder, text parts as their text).
_QWEN_VL_CONTENT = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for item in content -%}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif item.type == 'text' -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""
QWEN3_VL_TEMPLATE = _QWEN_VL_CONTENT + QWEN3_TEMPLATE.replace(
    _MESSAGE_LOOP_HEAD, _MESSAGE_LOOP_HEAD.replace(
        "message.content if message.content is string else ''", "render_content(message.content)"))

_QWEN_VISION = dict(depth=2, vision_hidden=32, vision_heads=2, vision_intermediate=64, deepstack=[0],
                    min_pixels=64 * 64, max_pixels=128 * 128)
QWEN3_VL_PRESETS: dict[str, dict] = {
    "tiny": {**qwen3.DENSE_PRESETS["tiny"], "max_position_embeddings": 262144, **_QWEN_VISION},
    "small": {**qwen3.DENSE_PRESETS["small"], "max_position_embeddings": 262144, "depth": 6, "vision_hidden": 256,
              "vision_heads": 4, "vision_intermediate": 1024, "deepstack": [1, 3], "min_pixels": 256 * 256,
              "max_pixels": 512 * 512},
    # Qwen3-VL-2B's vision tower on the 1b text shape
    "1b": {**qwen3.DENSE_PRESETS["1b"], "max_position_embeddings": 262144, "depth": 24, "vision_hidden": 1024,
           "vision_heads": 16, "vision_intermediate": 4096, "deepstack": [5, 11, 17], "min_pixels": 256 * 256,
           "max_pixels": 1024 * 1024},
}

GEMMA3_VL_PRESETS: dict[str, dict] = {
    "tiny": {**gemma3.PRESETS["tiny"], "vision_layers": 2, "vision_hidden": 32, "vision_heads": 2,
             "vision_intermediate": 64, "image_size": 64, "patch_size": 16, "mm_tokens": 4},
    "small": {**gemma3.PRESETS["small"], "vision_layers": 6, "vision_hidden": 384, "vision_heads": 6,
              "vision_intermediate": 1536, "image_size": 224, "patch_size": 14, "mm_tokens": 64},
    # gemma-3-4b's SigLIP (896px, 27 layers) on the 1b text shape
    "1b": {**gemma3.PRESETS["1b"], "vision_layers": 27, "vision_hidden": 1152, "vision_heads": 16,
           "vision_intermediate": 4304, "image_size": 896, "patch_size": 14, "mm_tokens": 256},
}

GEMMA3_VL_TOKENS = TokenSpec(
    control=gemma3.TOKENS.control, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
    stop=gemma3.TOKENS.stop, add_bos=True,
    tokenizer_extra={**gemma3.TOKENS.tokenizer_extra, "extra_special_tokens": {
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}},
)


def configure_qwen3_vl(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    text = {k: v for k, v in qwen3.configure_dense(dims, ids, vocab_size).items() if k != "architectures"}
    text.update(model_type="qwen3_vl_text", rope_theta=5000000.0,
                rope_scaling={"rope_type": "default", "mrope_interleaved": True,
                              "mrope_section": mrope_section(dims["head_dim"], 1.0)})
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_vl", "depth": dims["depth"], "hidden_size": dims["vision_hidden"],
            "num_heads": dims["vision_heads"], "intermediate_size": dims["vision_intermediate"],
            "out_hidden_size": dims["hidden_size"], "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": dims["deepstack"], "initializer_range": 0.02,
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": dims["tie"],
        "eos_token_id": ids["<|im_end|>"],
    }


def configure_gemma3_vl(dims: Mapping, ids: TokenIds, vocab_size: int) -> dict:
    text = {k: v for k, v in gemma3.configure(dims, ids, vocab_size).items() if k != "architectures"}
    text.update(mm_tokens_per_image=dims["mm_tokens"])
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model", "num_hidden_layers": dims["vision_layers"],
            "hidden_size": dims["vision_hidden"], "num_attention_heads": dims["vision_heads"],
            "intermediate_size": dims["vision_intermediate"], "image_size": dims["image_size"],
            "patch_size": dims["patch_size"], "vision_use_head": False, "layer_norm_eps": 1e-6,
        },
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"],
        "mm_tokens_per_image": dims["mm_tokens"],
        "hidden_size": dims["hidden_size"],
        "pad_token_id": ids["<pad>"],
        "vocab_size": vocab_size,
        "eos_token_id": ids_of(ids, gemma3.TOKENS.stop),
        "initializer_range": 0.02,
    }


def qwen3_vl_processor_files(dims: Mapping) -> dict[str, dict]:
    pre = {"size": {"shortest_edge": dims["min_pixels"], "longest_edge": dims["max_pixels"]}, "patch_size": 16,
           "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
           "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}
    return {"preprocessor_config.json": pre, "processor_config.json": {"processor_class": "Qwen3VLProcessor"}}


def gemma3_vl_processor_files(dims: Mapping) -> dict[str, dict]:
    side = dims["image_size"]
    pre = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
           "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": dims["mm_tokens"],
           "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 1 / 255,
           "size": {"height": side, "width": side}}
    return {"preprocessor_config.json": pre,
            "processor_config.json": {"image_seq_length": dims["mm_tokens"], "processor_class": "Gemma3Processor"}}


def make_vlm(arch: str, out: Path, preset_name: str, seed: int, quantize: int | None) -> dict:
    """The whole folder: the text family's tokenizer and template, the processor's files, mlx-vlm's weights."""
    from worker.mlx_engine.make_model.tokenizer import build_tokenizer, token_ids, write_tokenizer

    if quantize:
        raise ValueError("--quantize is not offered for vision families yet")
    family, processor_files = VISION_FAMILIES[arch]
    dims = family.presets[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family.tokens, dims["vocab"], seed)
    ids = token_ids(tok, family.tokens)
    config = family.configure(dims, ids, tok.get_vocab_size())
    write_tokenizer(out, tok, family, int(config["text_config"]["max_position_embeddings"]))
    if family.generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(family.generation_config(ids), indent=2))
    for name, content in processor_files(dims).items():
        (out / name).write_text(json.dumps(content, indent=2))
    written = write_vlm_weights(out, config, str(dims.get("dtype", "float32")), seed)
    return {"path": str(out), "arch": arch, "preset": preset_name, "quantize": None,
            "vocab_size": tok.get_vocab_size(), **written}


QWEN3_VL = Family(arch="qwen3_vl", description="Qwen3-VL: Qwen3 text layers with M-RoPE, a ViT tower with "
                                               "deepstack features (images; mlx-vlm)",
                  presets=QWEN3_VL_PRESETS, tokens=qwen3.TOKENS, chat_template=QWEN3_VL_TEMPLATE,
                  configure=configure_qwen3_vl, generation_config=qwen3.generation_config,
                  make=partial(make_vlm, "qwen3_vl"))
GEMMA3_VL = Family(arch="gemma3_vl", description="Gemma 3 with its SigLIP vision tower (images; mlx-vlm): "
                                                 "sliding-window layers + a global layer every 6th",
                   presets=GEMMA3_VL_PRESETS, tokens=GEMMA3_VL_TOKENS, chat_template=gemma3.CHAT_TEMPLATE,
                   configure=configure_gemma3_vl, generation_config=gemma3.generation_config, tools=False,
                   make=partial(make_vlm, "gemma3_vl"))
ProcessorFiles = Callable[[Mapping], dict[str, dict]]  # file name -> its JSON
VISION_FAMILIES: dict[str, tuple[Family, ProcessorFiles]] = {
    "qwen3_vl": (QWEN3_VL, qwen3_vl_processor_files), "gemma3_vl": (GEMMA3_VL, gemma3_vl_processor_files)}


def build_vlm(config: dict, seed: int) -> nn.Module:
    """mlx-vlm's model for this config, randomly initialised, its weights checked to load unmapped."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, sanitize_weights, update_module_configs

    mx.random.seed(seed)
    arch, _ = get_model_and_args(config)
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config, ["text", "vision"])
    model = arch.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    if tied_embeddings(config):
        weights.pop("language_model.lm_head.weight", None)  # gemma3's sanitize rebuilds it from the embedding
    sanitized = sanitize_weights(model, dict(weights))
    sanitized = sanitize_weights(arch.VisionModel, sanitized, model_config.vision_config)
    sanitized = sanitize_weights(arch.LanguageModel, sanitized, model_config.text_config)
    remapped = sorted(k for k in weights if k not in sanitized or sanitized[k] is not weights[k])
    if remapped:
        raise RuntimeError(f"mlx-vlm's sanitize() would re-map these weights on load: {remapped[:5]}")
    return model


def write_vlm_weights(out: Path, config: dict, dtype_name: str, seed: int) -> dict:
    """Build, cast, save weights (one safetensors file and its index) and config.json; what was written, in numbers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import save_config

    from worker.mlx_engine.make_model.weights import cast, count_parameters

    model = build_vlm(config, seed)
    parameters = count_parameters(model)
    cast(model, dtype_name)
    weights = dict(tree_flatten(model.parameters()))
    if tied_embeddings(config):
        weights.pop("language_model.lm_head.weight", None)  # the checkpoint carries none, as Google's
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    save_config(dict(config), out / "config.json")
    return {"parameters": parameters, "bits_per_weight": None,
            "weights_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
