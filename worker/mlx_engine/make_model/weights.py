"""Random weights for a config.json, built by mlx-lm's own model class and written the way mlx-lm writes them.

The path is mlx-lm's converter's, minus the download: the model class `mlx_lm.load` would pick
for this config is built (its initialisers give the random weights), cast to the preset's dtype
under the model's `cast_predicate` (Qwen3.5 keeps `A_log` in float32), quantized if asked by
`mlx_lm.utils.quantize_model` (affine, group size 64, the model's own `quant_predicate`: gpt-oss
keeps its router at 8 bits), and saved by `save_model` / `save_config` (model.safetensors, its
index, the `quantization` entry in config.json).

Invariant: the weights are already in the layout `mlx_lm.load` expects: before anything is
written, the model's `sanitize()` is run on them and must hand every array back unchanged under
the same name (else loading would re-map them), and a tied checkpoint carries no `lm_head`.
"""

from __future__ import annotations

import contextlib
import io
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from worker.mlx_engine.make_model.family import GROUP_SIZE

if TYPE_CHECKING:
    import mlx.nn as nn


def tied_embeddings(config: dict) -> bool:
    """Hugging Face's default for `tie_word_embeddings` is true; Qwen3.5 keeps it under text_config."""
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def build_model(config: dict, seed: int) -> nn.Module:
    """The model class and arguments `mlx_lm.load` would use for this config, randomly initialised (lazily)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if tied_embeddings(config):
        weights.pop("lm_head.weight", None)  # gemma3's class builds one and drops it when the checkpoint has none
    sanitized = model.sanitize(dict(weights)) if hasattr(model, "sanitize") else weights
    remapped = sorted(set(weights) ^ set(sanitized)) + [k for k in weights if k in sanitized and sanitized[k] is not weights[k]]
    if remapped:
        raise RuntimeError(f"mlx-lm's sanitize() would re-map these weights on load: {remapped[:5]}")
    model.load_weights(list(sanitized.items()), strict=True)
    return model


def count_parameters(model: nn.Module) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return sum(typing.cast(mx.array, kv[1]).size for kv in tree_flatten(model.parameters()))


def cast(model: nn.Module, dtype_name: str) -> None:
    """mlx-lm's converter's cast: floating parameters to `dtype`, except where the model's cast_predicate says no."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    dtype = getattr(mx, dtype_name)
    keep = getattr(model, "cast_predicate", lambda _path: True)

    def set_dtype(path: str, value: mx.array) -> mx.array:
        return value.astype(dtype) if keep(path) and mx.issubdtype(value.dtype, mx.floating) else value

    model.update(tree_map_with_path(set_dtype, model.parameters()))


def quantize(model: nn.Module, config: dict, bits: int) -> tuple[nn.Module, dict, float]:
    """mlx-lm's quantize_model (affine, group size 64, the model's quant_predicate); returns bits per weight too."""
    from mlx_lm.utils import compute_bits_per_weight, quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # it prints an [INFO] line; the caller reports instead
        model, config = quantize_model(model, config, GROUP_SIZE, bits, mode="affine")
    return model, config, compute_bits_per_weight(model)


def write_weights(out: Path, config: dict, dtype_name: str, seed: int, bits: int | None) -> dict:
    """Build, cast, quantize (if `bits`), save weights and config.json; what was written, in numbers."""
    from mlx_lm.utils import save_config, save_model

    model = build_model(config, seed)
    parameters = count_parameters(model)
    cast(model, dtype_name)
    bits_per_weight = None
    if bits:
        model, config, bits_per_weight = quantize(model, config, bits)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    return {"parameters": parameters, "bits_per_weight": bits_per_weight,
            "weights_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}


def write_mtp_head(out: Path, seed: int) -> int:
    """Random weights of Qwen3.5's MTP head (`mtp.*`, the layout its checkpoints ship: worker/mlx_engine/mtp.py) in
    model-mtp.safetensors beside a qwen3_5 model's, its config's `mtp_num_hidden_layers` and index updated; their
    bytes. mlx-lm's load drops them, as it drops a real checkpoint's."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_5 import TextModelArgs

    from worker.mlx_engine.mtp import MTPHead

    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config")
    if config.get("model_type") != "qwen3_5" or not isinstance(text, dict):
        raise ValueError(f"an MTP head is Qwen3.5's: {out} holds a {config.get('model_type')} model")
    if config.get("quantization"):
        raise ValueError("the MTP head is written in the model's float dtype: not beside quantized weights")
    mx.random.seed(seed + 1)
    head = MTPHead(TextModelArgs.from_dict(text), None, None)  # type: ignore[arg-type]
    dtype = getattr(mx, text.get("dtype") or "float32")
    flat = typing.cast(list[tuple[str, mx.array]], tree_flatten(head.parameters()))
    weights = {f"mtp.{name}": v.astype(dtype) for name, v in flat}
    mx.save_safetensors(str(out / "model-mtp.safetensors"), weights, metadata={"format": "mlx"})
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=4))
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update(dict.fromkeys(weights, "model-mtp.safetensors"))
        index.write_text(json.dumps(data, indent=4))
    return (out / "model-mtp.safetensors").stat().st_size


def write_dflash_drafter(out: Path, target: Path, seed: int, layers: int = 2, block: int = 8) -> dict:
    """A random-weight DFlash drafter for the model in `target` (worker/mlx_engine/dflash.py): dflash-mlx's
    `DFlashDraftModel` of `layers` decoder layers at the target's widths, reading `layers` of its layers (the
    checkpoints' own choice, `build_target_layer_ids`), blocks of `block`; config.json and model.safetensors in the
    layout z-lab's checkpoints ship. What was written, in numbers."""
    import json

    import mlx.core as mx
    from dflash_mlx.model import DFlashDraftModel, DFlashDraftModelArgs, build_target_layer_ids
    from mlx.utils import tree_flatten

    wanted = json.loads((target / "config.json").read_text())
    text = {**wanted, **(wanted.get("text_config") or {})}
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    n_target = int(text["num_hidden_layers"])
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "intermediate_size": int(text["intermediate_size"]),
        "num_attention_heads": heads, "num_key_value_heads": int(text.get("num_key_value_heads", heads)),
        "head_dim": int(text.get("head_dim") or hidden // heads), "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(text["vocab_size"]), "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
        "rope_theta": float(text.get("rope_theta", 1e6)), "tie_word_embeddings": True,
        "num_target_layers": n_target, "block_size": block,
        # the checkpoints' spread of target layers; a tiny target's first ones (too few layers to spread over)
        "dflash_config": {"target_layer_ids": build_target_layer_ids(n_target, layers) if n_target >= layers + 4
                          else list(range(min(layers, n_target))), "mask_token_id": 0},
        "dtype": text.get("dtype") or text.get("torch_dtype") or "float32",
    }
    mx.random.seed(seed)
    model = DFlashDraftModel(DFlashDraftModelArgs.from_dict(config))
    dtype = getattr(mx, str(config["dtype"]))
    flat = typing.cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(dtype) for k, v in flat},
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=4))
    return {"path": str(out), "arch": "dflash", "preset": f"{layers} layers, block {block}", "quantize": None,
            "vocab_size": config["vocab_size"], "parameters": sum(v.size for _, v in flat), "bits_per_weight": None,
            "weights_bytes": (out / "model.safetensors").stat().st_size}
