"""Where a model's SSD prompt cache lives, and how to empty it: the on-disk facts both sides share.

A model's cache directory is `<root>/<fingerprint>`. The fingerprint names the model's content
(weights, config, tokenizer), so KV blocks written for one model are never read for another,
and a model whose files change gets a fresh directory. The worker writes and reads the blocks;
the supervisor only needs to find and empty the directory of a model that is not loaded.

Hashing every weight byte of a multi-GB model at each load would cost seconds, so the weights
are fingerprinted by name, size, safetensors header (tensor names, shapes, dtypes, offsets) and
16 samples of 64 KiB spread over each file: two models that differ only in their weights
differ in every sample. Config and tokenizer files are hashed whole.

Pure standard library: no MLX, no imports from either side.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

BLOCK_SUFFIX = ".kvb"  # one complete KV block
TEMP_SUFFIX = ".tmp"  # a block being written; never read, removed at start-up
FINGERPRINT_CHARS = 24

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def _hash_weights(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if len(head) == 8:
            (header_len,) = struct.unpack("<Q", head)
            h.update(f.read(min(header_len, 64 * 2**20)))
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            h.update(f.read(_SAMPLE_BYTES))


def model_fingerprint(model_path: Path) -> str:
    """A short hex digest of the model's weights, config and tokenizer (see the module docstring)."""
    h = hashlib.sha256(b"mlxsup-model-fingerprint-1\0")
    for name in ("config.json", *_TOKENIZER_FILES):
        p = model_path / name
        if p.is_file():
            h.update(f"{name}\0".encode())
            h.update(p.read_bytes())
    for p in sorted(model_path.glob("*.safetensors")):
        _hash_weights(h, p)
    return h.hexdigest()[:FINGERPRINT_CHARS]


def model_cache_dir(root: Path, model_path: Path) -> Path:
    return root / model_fingerprint(model_path)


def clear_dir(directory: Path) -> tuple[int, int]:
    """Remove every block and temp file in `directory`; return (blocks removed, bytes reclaimed).

    Only for a directory no worker owns (the model is not loaded): a worker clears its own.
    """
    entries = reclaimed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0, 0
    for name in names:
        if not name.endswith((BLOCK_SUFFIX, TEMP_SUFFIX)):
            continue
        path = directory / name
        try:
            size = path.lstat().st_size  # a symlink is removed, never followed
            path.unlink()
        except OSError:
            continue
        reclaimed += size
        entries += name.endswith(BLOCK_SUFFIX)
    return entries, reclaimed
