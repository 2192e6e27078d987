"""Whisper (speech to text): a random-weight checkpoint in mlx-community's layout (`whisper-tiny-asr`), for
worker/audio/engines.py, which serves it with mlx-audio's Whisper.

config.json holds the MLX dimensions (n_mels, n_audio_ctx, ..., n_vocab) and model_type "whisper", as
mlx-community's converted repos do; model.safetensors is mlx-audio's own Whisper class randomly initialised (its
parameter names, float16 as mlx-community's fp16 repos). The tokenizer is Hugging Face's Whisper tokenizer layout
(tokenizer.json, tokenizer_config.json, preprocessor_config.json: what WhisperProcessor reads): a byte-level BPE
trained locally, padded with letter strings to Whisper's 50257 text tokens, then Whisper's special tokens at their
real ids (<|endoftext|> 50257, <|startoftranscript|> 50258, 99 languages, <|translate|>, <|transcribe|>,
<|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|> 50363, then the 1501 timestamps <|0.00|> to
<|30.00|>): 51865 ids, the multilingual vocabulary. Random weights transcribe to gibberish of those letter strings.
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path
from typing import Any, cast

from worker.mlx_engine.make_model.family import Family, TokenSpec
from worker.mlx_engine.make_model.tokenizer import train_tokenizer

TEXT_TOKENS = 50257
LANGUAGE_CODES = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur "
                  "hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si "
                  "km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha "
                  "ba jw su").split()  # Whisper's 99, in its order
SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", *(f"<|{c}|>" for c in LANGUAGE_CODES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
            *(f"<|{i * 0.02:.2f}|>" for i in range(1501)))
VOCAB = TEXT_TOKENS + len(SPECIALS)  # 51865

PRESETS: dict[str, dict] = {  # tiny: for tests (Whisper's vocabulary and layers, narrower); openai/whisper-tiny, -small
    "tiny": dict(n_audio_state=64, n_audio_head=2, n_audio_layer=2),
    "small": dict(n_audio_state=384, n_audio_head=6, n_audio_layer=4),
    "1b": dict(n_audio_state=768, n_audio_head=12, n_audio_layer=12),
}


def configure(dims: dict) -> dict:
    return {"model_type": "whisper", "n_mels": 80, "n_audio_ctx": 1500, "n_vocab": VOCAB, "n_text_ctx": 448,
            **dims, "n_text_state": dims["n_audio_state"], "n_text_head": dims["n_audio_head"],
            "n_text_layer": dims["n_audio_layer"]}


def tokenizer_json(seed: int) -> str:
    """The Whisper-layout tokenizer.json (see the module docstring)."""
    tok = json.loads(train_tokenizer(4096, seed).to_str())
    vocab: dict[str, int] = tok["model"]["vocab"]
    fillers = ("".join(p) for n in itertools.count(2) for p in itertools.product(string.ascii_lowercase, repeat=n))
    for word in fillers:
        if len(vocab) >= TEXT_TOKENS:
            break
        for text in (f"\u0120{word}", word):  # byte-level's space is Ġ: half the fillers start a word
            if text not in vocab and len(vocab) < TEXT_TOKENS:
                vocab[text] = len(vocab)
    tok["added_tokens"] = [{"id": TEXT_TOKENS + i, "content": t, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    return json.dumps(tok, ensure_ascii=False)


def make(out: Path, preset: str, seed: int, quantize: int | None) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    if quantize is not None:
        raise ValueError("whisper is written unquantized")
    out.mkdir(parents=True, exist_ok=True)
    config = configure(PRESETS[preset])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").write_text(tokenizer_json(seed))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "WhisperTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 1024,
        "add_prefix_space": False, "errors": "replace"}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
        "feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
        "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
        "return_attention_mask": False}, indent=2))
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(config), mx.float16)
    weights = {k: v.astype(mx.float16) for k, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    parameters = sum(v.size for v in weights.values())
    return {"path": str(out), "arch": "whisper", "preset": preset, "quantize": None, "vocab_size": VOCAB,
            "parameters": parameters, "bits_per_weight": None,
            "weights_bytes": (out / "model.safetensors").stat().st_size}


WHISPER = Family(arch="whisper", description="speech to text, Whisper (mlx-community's layout; small: whisper-tiny's shape, 1b: whisper-small's)",
                 presets=PRESETS, tokens=TokenSpec(control=()), chat_template="", configure=lambda d, i, v: {},
                 tools=False, make=make)
