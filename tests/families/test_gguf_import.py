"""`mlxsup import` round trip: a made model written to GGUF the way llama.cpp's converter writes it (the `gguf`
package's writer, its quantizers, llama.cpp's Q/K row permutation, its tensor names and metadata keys), imported
back, must be the same model: bit-equal weights and logits for F32, and for Q4_0 / Q4_1 / Q8_0 the very values
`gguf`'s own dequantizer reads from the file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from worker.mlx_engine import gguf_import
from worker.mlx_engine.make_model import make_model

Q = gguf.GGMLQuantizationType
LAYER = {v: k for k, v in gguf_import.LAYER_NAMES.items()}
TOP = {v: k for k, v in gguf_import.TOP_NAMES.items()}


def gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, n, rest = stem.split(".", 3)
        return f"blk.{n}.{LAYER[rest]}.{suffix}"
    return f"{TOP[stem]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Path, out: Path, qtype: dict[str, int], meta: dict | None = None) -> dict[str, np.ndarray]:
    """The made model as a GGUF file; `qtype` maps a GGUF tensor-name fragment to its type (default F32), `meta`
    adds keys (a float is written as float32, an int as uint32, a str as a string).
    Returns what `gguf`'s dequantizer reads back for each tensor, under its Hugging Face name, rows unpermuted."""
    config = json.loads((model / "config.json").read_text())
    arch = config["model_type"]
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(model / "model.safetensors")).items()}
    tok = json.loads((model / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_chat_template((model / "chat_template.jinja").read_text() if (model / "chat_template.jinja").exists()
                        else json.loads((model / "tokenizer_config.json").read_text())["chat_template"])
    for key, value in (meta or {}).items():
        {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)](key, value)
    expected = {}
    for hf, arr in weights.items():
        name = gguf_name(hf)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            arr = permute(arr, heads if ".attn_q." in name else kv)
        kind = next((t for frag, t in qtype.items() if frag in name and arr.ndim == 2), Q.F32)
        data = gguf.quants.quantize(arr, kind) if kind != Q.F32 else arr
        w.add_tensor(name, data, raw_dtype=kind)
        back = gguf.quants.dequantize(data, kind).reshape(arr.shape)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            back = gguf_import.unpermute(mx.array(back), heads if ".attn_q." in name else kv)
        expected[hf] = np.array(back)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def made_model(root: Path, arch: str) -> Path:
    """make-model's tiny model of `arch`; qwen2 (no make-model family): mlx-lm's Qwen2 class, randomly initialised,
    on the tiny llama's dimensions and tokenizer, tied as Qwen2's small checkpoints are (q/k/v with biases)."""
    from mlx.utils import tree_flatten

    from worker.mlx_engine.make_model.weights import build_model

    if arch != "qwen2":
        make_model(root / arch, "tiny", seed=0, arch=arch)
        return root / arch
    base = root / "base"
    make_model(base, "tiny", seed=0, arch="llama")
    config = json.loads((base / "config.json").read_text())
    config |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True}
    out = root / "qwen2"
    shutil.copytree(base, out)
    (out / "config.json").write_text(json.dumps(config))
    for index in out.glob("*.index.json"):
        index.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(build_model(config, seed=0).parameters())))
    return out


def imported(gguf_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf_path), str(out), *extra],
                          capture_output=True, text=True, timeout=300)


def logits(model_dir: Path, text: str) -> tuple[np.ndarray, list[int]]:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(text)
    return np.array(model(mx.array(ids)[None]).astype(mx.float32)), ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_imports_as_the_same_model_bit_for_bit(tmp_path: Path, arch: str) -> None:
    made = made_model(tmp_path, arch)
    write_gguf(made, tmp_path / "m.gguf", {})
    run = imported(tmp_path / "m.gguf", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert "loading it once with mlx-lm" in run.stderr and "imported" in run.stdout

    original = mx.load(str(made / "model.safetensors"))
    converted = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert set(converted) == set(original)
    assert all(mx.array_equal(converted[k], original[k]).item() for k in original)  # names and Q/K rows restored
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    made_config = json.loads((made / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings", "eos_token_id"):
        assert config[key] == made_config[key], key
    text = "<|im_start|>user\nthe stair gra dou 12 + 7<|im_end|>\n"
    (want, want_ids), (got, got_ids) = logits(made, text), logits(tmp_path / "out", text)
    assert got_ids == want_ids  # the tokenizer rebuilt from GGUF metadata encodes as the original
    # the weights are bit-equal (above); two forward passes on MLX's CPU may still sum in another order
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5) and (got.argmax(-1) == want.argmax(-1)).all()


def test_q4_0_q4_1_q8_0_import_to_exactly_what_gguf_dequantizes(tmp_path: Path) -> None:
    made = tmp_path / "made"
    make_model(made, "tiny", seed=0, arch="llama")
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
             "ffn_": Q.Q4_1, "output.": Q.Q8_0}
    expected = write_gguf(made, tmp_path / "m.gguf", types)
    run = imported(tmp_path / "m.gguf", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"]) == (32, 4)
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8} and q["lm_head"] == {"group_size": 32, "bits": 8}
    converted = mx.load(str(tmp_path / "out" / "model.safetensors"))
    for hf, want in expected.items():
        layer = hf.removesuffix(".weight")
        if f"{layer}.scales" in converted:
            bits = q.get(layer, q)["bits"]
            got = mx.dequantize(converted[hf], converted[f"{layer}.scales"], converted[f"{layer}.biases"],
                                group_size=32, bits=bits)
        else:
            got = converted[hf]
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=1e-3, atol=1e-3, err_msg=hf)


def test_import_refuses_an_existing_folder_and_an_unmapped_architecture(tmp_path: Path) -> None:
    made = tmp_path / "made"
    make_model(made, "tiny", seed=0, arch="llama")
    write_gguf(made, tmp_path / "m.gguf", {})
    (tmp_path / "out").mkdir()
    run = imported(tmp_path / "m.gguf", tmp_path / "out")
    assert run.returncode == 2 and "already exists (pass --force" in run.stderr
    assert imported(tmp_path / "m.gguf", tmp_path / "out", "--force").returncode == 0

    other = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    other.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    run = imported(tmp_path / "x.gguf", tmp_path / "mamba")
    assert run.returncode == 2 and "architecture 'mamba' is not one mlxsup imports" in run.stderr, run.stderr
    assert not (tmp_path / "mamba").exists() and not list(tmp_path.glob(".mamba*"))
    (tmp_path / "notes.gguf").write_text("not a model")
    run = imported(tmp_path / "notes.gguf", tmp_path / "notes")
    assert run.returncode == 2 and "is not a GGUF file" in run.stderr and "Traceback" not in run.stderr

    whole = (tmp_path / "m.gguf").read_bytes()  # a download cut short: the header is there, the tensors are not
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) * 2 // 3])
    run = imported(tmp_path / "cut.gguf", tmp_path / "cut")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "cut").exists() and not list(tmp_path.glob(".cut*"))


def test_mlxsup_import_writes_into_the_model_dir_under_the_file_s_name(tmp_path: Path) -> None:
    made = tmp_path / "made"
    make_model(made, "tiny", seed=0, arch="qwen3")
    write_gguf(made, tmp_path / "Tiny-Qwen3.Q8_0.gguf", {"blk.": Q.Q8_0})
    mlxsup = [sys.executable, "-m", "supervisor"]
    env = {"XDG_CONFIG_HOME": str(tmp_path / "no-config"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([*mlxsup, "import", str(tmp_path / "Tiny-Qwen3.Q8_0.gguf"), "--model-dir", str(tmp_path / "models")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    config = json.loads((tmp_path / "models" / "Tiny-Qwen3.Q8_0" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["quantization"]["bits"] == 8
    assert "reading" in run.stderr and "loading it once with mlx-lm" in run.stderr  # progress on the terminal
    # no --model-dir, none configured, no daemon: the import folder every `mlxsup serve` watches (issue 49)
    alone = {**env, "XDG_STATE_HOME": str(tmp_path / "state"), "MLXSUP_URL": "http://127.0.0.1:9"}
    default = subprocess.run([*mlxsup, "import", str(tmp_path / "Tiny-Qwen3.Q8_0.gguf"), "--name", "x"],
                             capture_output=True, text=True, timeout=300, env=alone)
    assert default.returncode == 0, default.stderr
    assert (tmp_path / "state" / "mlxsup" / "models" / "x" / "config.json").is_file()
    assert "which every `mlxsup serve` watches (no daemon runs now)" in default.stderr


def test_a_type_mlx_cannot_read_is_dequantized_then_kept_in_bf16_or_quantized_as_asked(tmp_path: Path) -> None:
    made = made_model(tmp_path, "llama")
    expected = write_gguf(made, tmp_path / "m.gguf", {"ffn_": Q.Q5_0, "attn_": Q.Q8_0})  # Q5_0: not MLX's
    run = imported(tmp_path / "m.gguf", tmp_path / "bf16")
    assert run.returncode == 0 and "dequantizing with gguf" in run.stderr, run.stderr
    converted = mx.load(str(tmp_path / "bf16" / "model.safetensors"))
    assert "quantization" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    for hf, want in expected.items():
        assert converted[hf].dtype == (mx.bfloat16 if want.ndim == 2 else mx.float32), hf
        np.testing.assert_allclose(np.array(converted[hf].astype(mx.float32)), want, rtol=1e-2, atol=1e-2, err_msg=hf)

    run = imported(tmp_path / "m.gguf", tmp_path / "q8", "--quantize", "8")
    assert run.returncode == 0, run.stderr
    q = json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]
    assert (q["group_size"], q["bits"]) == (64, 8)
    converted = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    gate = "model.layers.0.mlp.gate_proj"
    got = mx.dequantize(converted[f"{gate}.weight"], converted[f"{gate}.scales"], converted[f"{gate}.biases"],
                        group_size=64, bits=8)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected[f"{gate}.weight"], rtol=0.05, atol=0.02)


def bare_gguf(path: Path, arch: str, **meta: int) -> Path:
    """A GGUF of one tensor whose metadata has only `general.architecture` and the `{arch}.KEY` integers given."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("meta, says", [
    ({}, "llama.attention.head_count, llama.block_count, llama.context_length, llama.embedding_length, "
         "llama.feed_forward_length"),
    ({"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "context_length": 256}, "llama.attention.head_count"),
    ({"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "context_length": 256,
      "attention.head_count": 0}, "llama.attention.head_count"),
], ids=["none", "no-heads", "zero-heads"])
def test_a_file_without_its_architecture_s_metadata_is_refused_in_one_line(tmp_path: Path, meta: dict, says: str) -> None:
    """Such a file used to end in a TypeError traceback (`hidden // heads` of two Nones)."""
    bare = bare_gguf(tmp_path / "bare.gguf", "llama", **meta)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "no-config"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "supervisor", "import", str(bare), "--model-dir", str(tmp_path / "models")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "llama" in error and says in error, error
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_a_file_without_a_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    bare = bare_gguf(tmp_path / "untokenized.gguf", "llama", block_count=1, embedding_length=32, feed_forward_length=64,
                     context_length=256, **{"attention.head_count": 4})
    run = imported(bare, tmp_path / "out")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "tokenizer" in run.stderr.strip().splitlines()[-1], run.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_the_file_s_sampling_metadata_becomes_the_folder_s_generation_config(tmp_path: Path) -> None:
    """What llama.cpp's converter writes from a model's generation_config (general.sampling.*) is its default
    sampling again (issue 49); a file with none, of a model mlxsup knows nothing of, gets no generation_config."""
    made = made_model(tmp_path, "llama")
    write_gguf(made, tmp_path / "sampled.gguf", {}, {"general.sampling.temp": 0.4, "general.sampling.top_k": 30,
                                                     "general.sampling.top_p": 0.95})
    run = imported(tmp_path / "sampled.gguf", tmp_path / "sampled")
    assert run.returncode == 0, run.stderr
    written = json.loads((tmp_path / "sampled" / "generation_config.json").read_text())
    assert written == {"do_sample": True, "temperature": 0.4, "top_p": 0.95, "top_k": 30}
    assert "default sampling temperature 0.4, top_p 0.95, top_k 30 (the GGUF's general.sampling metadata)" in run.stderr
    write_gguf(made, tmp_path / "plain.gguf", {}, {"general.basename": "Tiny"})
    run = imported(tmp_path / "plain.gguf", tmp_path / "plain")
    assert run.returncode == 0 and not (tmp_path / "plain" / "generation_config.json").exists(), run.stderr
