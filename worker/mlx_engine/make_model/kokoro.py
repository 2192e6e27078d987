"""Kokoro (text to speech): a random-weight checkpoint in hexgrad/Kokoro-82M's layout, as mlx-audio loads it
(worker/audio/engines.py).

config.json carries Kokoro's fields (istftnet, plbert, hidden_dim, n_token 178, style_dim, the phoneme `vocab`,
Kokoro's symbols at their ids); model.safetensors holds mlx-audio's Kokoro class randomly initialised under the
PyTorch checkpoint's names and shapes (LSTM `weight_ih_l0[_reverse]`, convolutions' `weight_v` as (out, in, kernel)),
which mlx-audio's `sanitize` maps back, so loading it goes through the path a real checkpoint takes; voices/*.safetensors
are voice packs of Kokoro's shape (510 lengths x 1 x 2*style_dim). "small" is Kokoro-82M's own shape; "tiny" keeps its
layers and narrows them (for tests). Random weights speak noise of the length the duration predictor gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from worker.mlx_engine.make_model.family import Family, TokenSpec

# Kokoro's phoneme symbols (misaki's set) and their ids
SYMBOLS = (';:,.!?' '\u2014\u2026"()\u201c\u201d ' '\u0303\u02a3\u02a5\u02a6\u02a8\u1d5d\uab67AIOQSTWY\u1d4a'
           'abcdefhijklmnopqrstuvwxyz\u0251\u0250\u0252\u00e6\u03b2\u0254\u0255\u00e7\u0256\u00f0\u02a4\u0259\u025a'
           '\u025b\u025c\u025f\u0261\u0265\u0268\u026a\u029d\u026f\u0270\u014b\u0273\u0272\u0274\u00f8\u0278\u03b8'
           '\u0153\u0279\u027e\u027b\u0281\u027d\u0282\u0283\u0288\u02a7\u028a\u028b\u028c\u0263\u0264\u03c7\u028e'
           '\u0292\u0294\u02c8\u02cc\u02d0\u02b0\u02b2\u2193\u2192\u2197\u2198\u1d7b')
VOICES = ("af_heart", "am_adam")  # the first is the model's default voice (and OpenAI's voice names map to it)
VOICE_LENGTHS = 510

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden=512, bert=64, bert_heads=2, bert_ffn=128, bert_layers=2, channel=512),
    "small": dict(hidden=512, bert=768, bert_heads=12, bert_ffn=2048, bert_layers=12, channel=512),  # Kokoro-82M
    "1b": dict(hidden=512, bert=768, bert_heads=12, bert_ffn=2048, bert_layers=12, channel=512),
}


def configure(dims: dict) -> dict:
    return {
        "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6], "gen_istft_hop_size": 5,
                     "gen_istft_n_fft": 20, "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                     "resblock_kernel_sizes": [3, 7, 11], "upsample_initial_channel": dims["channel"]},
        "dim_in": 64, "dropout": 0.2, "hidden_dim": dims["hidden"], "max_conv_dim": dims["hidden"], "max_dur": 50,
        "multispeaker": True, "n_layer": 3, "n_mels": 80, "n_token": 178, "style_dim": 128,
        "text_encoder_kernel_size": 5,
        "plbert": {"hidden_size": dims["bert"], "num_attention_heads": dims["bert_heads"],
                   "intermediate_size": dims["bert_ffn"], "max_position_embeddings": 512,
                   "num_hidden_layers": dims["bert_layers"], "dropout": 0.1},
        "vocab": {s: i + 1 for i, s in enumerate(dict.fromkeys(SYMBOLS))},
        "model_type": "kokoro", "sample_rate": 24000,
    }


LSTM_NAMES = {"Wx_forward": "weight_ih_l0", "Wh_forward": "weight_hh_l0", "bias_ih_forward": "bias_ih_l0",
              "bias_hh_forward": "bias_hh_l0", "Wx_backward": "weight_ih_l0_reverse",
              "Wh_backward": "weight_hh_l0_reverse", "bias_ih_backward": "bias_ih_l0_reverse",
              "bias_hh_backward": "bias_hh_l0_reverse"}


def checkpoint_names(weights: dict) -> dict:
    """mlx-audio's parameters under the PyTorch checkpoint's names and shapes: what its `sanitize` undoes."""
    from mlx_audio.tts.models.base import check_array_shape

    out = {}
    for key, v in weights.items():
        base, _, last = key.rpartition(".")
        if last in LSTM_NAMES:
            key = f"{base}.{LSTM_NAMES[last]}"
        elif key.endswith(("F0_proj.weight", "N_proj.weight")) or ("noise_convs" in key and last == "weight"):
            v = v.transpose(0, 2, 1)
        elif last == "weight_v" and not check_array_shape(v):
            v = v.transpose(0, 2, 1)
        out[key] = v
    return out


def randomised(weights: dict) -> dict:
    """mlx-audio's fresh Kokoro with random directions: its weight-normalised convolutions start at all-ones `weight_v`
    (degenerate: the decoder's output overflows to NaN), so each gets normal values scaled by its fan-in; and the
    duration head a bias that makes about two frames per phoneme (random weights would give up to 50 each, a second
    of noise per phoneme, slow to synthesise on a CPU)."""
    import mlx.core as mx

    out = {}
    for key, v in weights.items():
        if key.endswith("weight_v"):
            v = mx.random.normal(v.shape) / (v.shape[1] * v.shape[2]) ** 0.5
        elif key == "predictor.duration_proj.linear_layer.weight":
            v = v * 0.1
        elif key == "predictor.duration_proj.linear_layer.bias":
            v = mx.full(v.shape, -3.0)
        out[key] = v
    return out


def make(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig

    if quantize is not None:
        raise ValueError("kokoro is written unquantized")
    out.mkdir(parents=True, exist_ok=True)
    config = configure(PRESETS[preset])
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    weights = checkpoint_names(randomised(dict(cast(list[tuple[str, Any]], tree_flatten(model.parameters())))))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "voices").mkdir(exist_ok=True)
    for i, name in enumerate(VOICES):
        key = mx.random.key(seed * 1000 + i)
        voice = mx.random.normal((VOICE_LENGTHS, 1, 2 * config["style_dim"]), key=key) * 0.5
        mx.save_safetensors(str(out / "voices" / f"{name}.safetensors"), {"voice": voice})
    return {"path": str(out), "arch": "kokoro", "preset": preset, "quantize": None, "vocab_size": config["n_token"],
            "parameters": sum(v.size for v in weights.values()), "bits_per_weight": None,
            "weights_bytes": (out / "model.safetensors").stat().st_size}


KOKORO = Family(arch="kokoro", description="text to speech, Kokoro (hexgrad/Kokoro-82M's layout; small: its shape)",
                presets=PRESETS, tokens=TokenSpec(control=()), chat_template="", configure=lambda d, i, v: {},
                tools=False, make=make)
