"""Where a model's SSD prompt cache lives, and how to empty it: the on-disk facts both sides share.

A model's cache directory is `<root>/<fingerprint>`. The fingerprint names the model's content
(weights, config, tokenizer), so KV blocks written for one model are never read for another,
and a model whose files change gets a fresh directory. The worker writes and reads the blocks;
the supervisor only needs to find and empty the directory of a model that is not loaded.

Every byte of the weights counts: each safetensors file is hashed whole (sha256 over 64 MiB segments, the
segments on HASH_THREADS threads, since hashlib and pread release the GIL; the file's digest is the sha256 of
its size and the segments' digests). The old fingerprint read the name, size, header and 16 samples of 64 KiB,
and two 98 MB models that differed in 6 MB between two samples shared one directory, each reading the other's
K/V. Config and tokenizer files are hashed whole too.

Hashing costs a pass over the weights (on the 2-core CI machine a 2 GiB file took ~3 s from the page cache,
~6.5 s from disk), so each file's digest is kept under `<root>/.fingerprints/` (one small JSON file per weights
file, 0600 in a 0700 directory), keyed by the file's device, inode, size, mtime and ctime: a restart, another
worker of the model or the supervisor's clear reads it back for the cost of a stat. ctime is in the key because a
program can put a file's mtime back after rewriting it in place but cannot set its ctime: what is left is a file
whose content changes while all five stay the same, i.e. a write that bypasses the file system (a raw device, a
clock set back to the instant of the hash, a file system that does not keep ctime); that one would be served the
K/V of its old content. A digest is kept only when the file's identity was the same before and after its hash.

The old (sampled) fingerprint's directory of a model is retired (its blocks removed) when the model's new one is
found (`legacy_cache_dir`, `retire`), so an upgrade does not leave a cap's worth of unreachable blocks per model on disk.

Pure standard library: no MLX, no imports from either side.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK_SUFFIX = ".kvb"  # one complete KV block
TEMP_SUFFIX = ".tmp"  # a block being written; never read, removed at start-up
FINGERPRINT_CHARS = 24
DIGESTS = ".fingerprints"  # under the cache root: each weights file's digest, kept by the file's identity
SEGMENT_BYTES = 64 * 2**20  # a weights file is hashed in segments this large, several at once
CHUNK_BYTES = 4 * 2**20  # read at a time by each hashing thread
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(directory: Path) -> None:
    """`directory` and any missing parent created 0700; the directory itself narrowed to 0700 if it was wider."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            pass
    if directory.stat().st_mode & 0o077:
        os.chmod(directory, 0o700)


# --- the weights' digests ------------------------------------------------------------------------


def _segment(path: Path, start: int, end: int) -> bytes:
    h = hashlib.sha256()
    buf = memoryview(bytearray(min(CHUNK_BYTES, max(end - start, 1))))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        at = start
        while at < end:
            n = os.preadv(fd, [buf[:min(len(buf), end - at)]], at)
            if n <= 0:
                raise OSError(f"{path} ended at byte {at} while it was hashed")
            h.update(buf[:n])
            at += n
    finally:
        os.close(fd)
    return h.digest()


def _hash_files(paths: list[Path]) -> list[str]:
    """Each file's digest over every byte: sha256(size, its segments' sha256 in order), the segments of all the
    files hashed on HASH_THREADS threads."""
    sizes = [os.stat(p).st_size for p in paths]
    jobs = [(i, start) for i, size in enumerate(sizes) for start in range(0, size, SEGMENT_BYTES)]
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="fingerprint") as pool:
        parts = list(pool.map(lambda job: _segment(paths[job[0]], job[1], min(job[1] + SEGMENT_BYTES,
                                                                               sizes[job[0]])), jobs))
    out = []
    for i, size in enumerate(sizes):
        h = hashlib.sha256(f"mlxsup-weights-1\0{size}\0".encode())
        for (j, _), part in zip(jobs, parts):
            if j == i:
                h.update(part)
        out.append(h.hexdigest())
    return out


def _identity(st: os.stat_result) -> dict[str, int]:
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _kept_path(digests: Path, real: Path) -> Path:
    return digests / f"{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json"


def _kept(digests: Path, real: Path, identity: dict[str, int]) -> str | None:
    try:
        entry = json.loads(_kept_path(digests, real).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("path") != str(real) or \
            any(entry.get(k) != v for k, v in identity.items()):
        return None
    digest = entry.get("digest")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _keep(digests: Path, real: Path, identity: dict[str, int], digest: str) -> None:
    """Written whole (a private temp file renamed); a cache that cannot be written only costs the next hash."""
    final = _kept_path(digests, real)
    tmp = final.with_name(f"{final.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    try:
        private_dir(digests)
        with os.fdopen(os.open(tmp, _CREATE, 0o600), "w") as f:
            json.dump({"path": str(real), **identity, "digest": digest}, f)
        os.replace(tmp, final)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # no directory to hold it (the root under a file): nothing was written
            pass


def weights_digests(paths: list[Path], digests: Path | None = None, hash_missing: bool = True) -> list[str | None]:
    """The digest of every byte of each file (links followed); with `digests`, those kept there for a file of the
    same identity are taken as they are, and the others kept there once hashed (see the module docstring); without
    `hash_missing`, those not kept are None, and nothing is read but the kept digests."""
    real = [p.resolve() for p in paths]
    before = [_identity(os.stat(p)) for p in real]
    found = [_kept(digests, p, i) if digests is not None else None for p, i in zip(real, before)]
    todo = [k for k, d in enumerate(found) if d is None] if hash_missing else []
    for k, digest in zip(todo, _hash_files([real[k] for k in todo]) if todo else []):
        found[k] = digest
        if digests is not None and _identity(os.stat(real[k])) == before[k]:  # unchanged while it was read
            _keep(digests, real[k], before[k], digest)
    return found


# --- the fingerprint and the directory ---------------------------------------------------------------


def _fingerprint(model_path: Path, digests: Path | None, hash_missing: bool) -> str | None:
    h = hashlib.sha256(b"mlxsup-model-fingerprint-2\0")
    for name in ("config.json", *_TOKENIZER_FILES):
        p = model_path / name
        if p.is_file():
            h.update(f"{name}\0".encode())
            h.update(p.read_bytes())
    weights = sorted(model_path.glob("*.safetensors"))
    for p, digest in zip(weights, weights_digests(weights, digests, hash_missing), strict=True):
        if digest is None:
            return None
        h.update(f"{p.name}\0{digest}\0".encode())
    return h.hexdigest()[:FINGERPRINT_CHARS]


def model_fingerprint(model_path: Path, digests: Path | None = None) -> str:
    """A short hex digest of the model's weights (every byte), config and tokenizer; `digests`: where the weights'
    digests are kept (`model_cache_dir` keeps them under the cache root)."""
    fingerprint = _fingerprint(model_path, digests, True)
    assert fingerprint is not None
    return fingerprint


def model_cache_dir(root: Path, model_path: Path) -> Path:
    """`<root>/<fingerprint>`, the weights' digests kept under `<root>/.fingerprints`."""
    return root / model_fingerprint(model_path, root / DIGESTS)


def known_cache_dir(root: Path, model_path: Path) -> Path | None:
    """`model_cache_dir` from the kept digests alone, nothing hashed; None when one is not kept for the weights as
    they are now. Then no worker has written blocks for them (a worker keeps its digests before its first block;
    only a digest file it could not write breaks that, and costs those blocks a clear), and there is nothing to
    clear: the supervisor's clear of every model must not read every byte of every model on disk."""
    fingerprint = _fingerprint(model_path, root / DIGESTS, False)
    return None if fingerprint is None else root / fingerprint


def _legacy_fingerprint(model_path: Path) -> str:
    """The fingerprint before every byte counted (name, size, safetensors header, 16 samples of 64 KiB per
    weights file): only to find the directory an older mlxsup left, never to name one."""
    h = hashlib.sha256(b"mlxsup-model-fingerprint-1\0")
    for name in ("config.json", *_TOKENIZER_FILES):
        p = model_path / name
        if p.is_file():
            h.update(f"{name}\0".encode())
            h.update(p.read_bytes())
    for p in sorted(model_path.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                (header_len,) = struct.unpack("<Q", head)
                h.update(f.read(min(header_len, 64 * 2**20)))
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(64 * 1024))
    return h.hexdigest()[:FINGERPRINT_CHARS]


def legacy_cache_dir(root: Path, model_path: Path) -> Path:
    """The directory an older mlxsup named for this model (the sampled fingerprint)."""
    return root / _legacy_fingerprint(model_path)


def retire(old: Path, current: Path) -> tuple[int, int]:
    """Empty and remove `old`, a directory no mlxsup reads any more (an older fingerprint's, which may have been
    shared with a model of other weights), unless it is `current`; (blocks removed, bytes reclaimed)."""
    if old == current or not old.is_dir():
        return 0, 0
    removed = clear_dir(old)
    try:
        old.rmdir()
    except OSError:
        pass  # something else in it (not ours to remove): the blocks are gone all the same
    return removed


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
