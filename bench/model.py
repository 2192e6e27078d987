"""The benchmark model: one from `mlxsup make-model`, plus a bench-only view of it whose EOS can never be sampled.

Random weights emit EOS early at random, and the three sides stop on it differently (mlxsup has
`ignore_eos`, mlx_lm.server has none, in-process code chooses). So the benchmark serves a copy of
the model folder in which EOS is a token the model cannot produce: a special token added to the
tokenizer with id == vocab_size, one past the last row of lm_head. config.json's eos_token_id and
the tokenizer's eos_token point at it. Weights are the same file (a symlink), so compute is
unchanged; every side then generates exactly max_tokens tokens, which the benchmark also checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import REPO

NEVER_EOS = "<|bench_never|>"


def make_source_model(path: Path, preset: str, seed: int = 0) -> Path:
    """Run `mlxsup make-model` (python -m worker.mlx_engine.make_model) unless the folder already holds a model."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(path), "--preset", preset, "--seed", str(seed)],
                   check=True, cwd=REPO, timeout=1800)
    return path


def make_never_eos_view(src: Path, dst: Path) -> dict:
    """Write `dst`: src's config and tokenizer with an unreachable EOS, weights symlinked."""
    from tokenizers import Tokenizer

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    text = {**cfg, **(cfg.get("text_config") or {})}  # Qwen3.5 nests its text model's fields
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if tok.token_to_id(NEVER_EOS) is None:
        tok.add_special_tokens([NEVER_EOS])
    eos_id = tok.token_to_id(NEVER_EOS)
    if eos_id < text["vocab_size"]:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than the model's "
                           f"{cfg['vocab_size']} logits: cannot make an unreachable EOS this way")
    tok.save(str(dst / "tokenizer.json"))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["eos_token"] = NEVER_EOS
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    stm = src / "special_tokens_map.json"
    if stm.exists():
        sm = json.loads(stm.read_text())
        sm["eos_token"] = NEVER_EOS
        (dst / "special_tokens_map.json").write_text(json.dumps(sm, indent=2))
    original_eos = cfg.get("eos_token_id")
    cfg["eos_token_id"] = eos_id
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.glob("*.safetensors"):
        link = dst / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(f.resolve(), link)
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    return {"source": str(src), "path": str(dst), "eos_token_id": eos_id, "original_eos_token_id": original_eos,
            "vocab_size": text["vocab_size"], "weights_bytes": weights, "dtype": text.get("torch_dtype"),
            "hidden_size": text["hidden_size"], "layers": text["num_hidden_layers"]}
