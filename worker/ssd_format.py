"""The SSD cache's file format: one block per file, versioned, tied to one model fingerprint and cache layout.

    offset 0   8 bytes   magic b"MLXSUPKV"
    offset 8   u32 LE    FORMAT_VERSION
    offset 12  u32 LE    header length H
    offset 16  H bytes   header, UTF-8 JSON: fingerprint, layout, key, parent, depth, tokens,
                         arrays [{name, dtype, shape, crc32}], snapshot (its JSON meta or null),
                         payload_bytes, tail (true: a partial last block, fewer tokens; absent: false)
    16 + H     payload   each array's bytes in the header's order, C order, nothing else

An array named "kv:..." is the block's K/V (or their quantized parts); one named "snap:..." is
part of the snapshot of the layers that cannot be cut into blocks (worker/mlx_engine/layer_state.py).
A block is exactly `block_tokens` tokens, so the payload is only the used part of the buffers; a tail
(a finished sequence's partial last block, found by its parent: worker/mlx_engine/kv_blocks.py) has fewer.
bfloat16 travels as its raw 16-bit pattern (numpy has no bfloat16). No pickle: the header is JSON
and the payload raw bytes. Version 1 (keys and values only) files are dropped at rebuild, as is a
file written under another `layout` (another cache class list or `kv_bits`).

`read_header` checks what is cheap to check at start-up (magic, version, fingerprint, layout, key
and the file's size against the header: a partial file fails it); `read_block` also checks each
array's CRC-32 before it is used, and can leave a snapshot it does not need unread: it opens the file
once and reads the header and the payload it uses in one read each. Both open only
regular files, never through a symlink nor waiting on a FIFO (`open_block`), and raise BadBlock on
anything wrong.

Pure numpy and the standard library: the writer thread uses this, and it must not touch MLX.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"MLXSUPKV"
FORMAT_VERSION = 2  # 1: keys and values only; 2: named arrays, snapshots, the cache layout
_PREFIX = struct.Struct("<8sII")
MAX_HEADER_BYTES = 1 << 20
SNAPSHOT_PREFIX = "snap:"

# The dtypes a stored array may have: name -> the numpy dtype its bytes are kept as.
STORED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32,
                 "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "bool": np.bool_}


class BadBlock(ValueError):
    """A file that is not a complete, intact block of this format, model and key."""


@dataclass(slots=True)
class BlockData:
    """A block as plain numpy, for the writer thread and from the disk."""

    key: bytes
    parent: bytes
    depth: int
    tokens: tuple[int, ...]
    arrays: dict[str, np.ndarray]  # "kv:k", "kv:v" (or quantized parts), "snap:<path>" for a snapshot
    dtypes: dict[str, str]  # each array's MLX dtype name (bfloat16 is stored as uint16)
    snapshot: dict | None = field(default=None)  # the snapshot's meta (JSON); None: no snapshot
    tail: bool = False  # a finished sequence's partial last block (fewer tokens; found by its parent)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _bytes_of(a: np.ndarray) -> memoryview:
    """The array's bytes in C order, without a copy when it is contiguous already."""
    return np.ascontiguousarray(a).data.cast("B")


def _header(block: BlockData, fingerprint: str, layout: str) -> bytes:
    arrays = [{"name": name, "dtype": block.dtypes[name], "shape": list(a.shape), "crc32": zlib.crc32(_bytes_of(a))}
              for name, a in block.arrays.items()]
    return json.dumps({
        "fingerprint": fingerprint, "layout": layout, "key": block.key.hex(), "parent": block.parent.hex(),
        "depth": block.depth, "tokens": list(block.tokens), "arrays": arrays, "snapshot": block.snapshot,
        "payload_bytes": block.nbytes, **({"tail": True} if block.tail else {}),
    }, separators=(",", ":")).encode()


def write_block(f: BinaryIO, block: BlockData, fingerprint: str, layout: str = "") -> int:
    """Write `block` to an open file; return the bytes written."""
    header = _header(block, fingerprint, layout)
    f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)))
    f.write(header)
    for a in block.arrays.values():
        f.write(_bytes_of(a))
    return _PREFIX.size + len(header) + block.nbytes


HEAD_READ = 64 * 2**10  # the first read of a file: its prefix and, mostly, its whole header


def _parse_prefix(f: BinaryIO) -> dict:
    """The header at the start of `f`, its payload's offset in "_data_offset"; `f` is left just after the header."""
    head = f.read(HEAD_READ)
    if len(head) < _PREFIX.size:
        raise BadBlock("truncated before the header")
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise BadBlock("not a KV block file")
    if version != FORMAT_VERSION:
        raise BadBlock(f"format version {version}, this worker reads {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise BadBlock("header too large")
    end = _PREFIX.size + header_len
    raw = head[_PREFIX.size:end] + (f.read(end - len(head)) if end > len(head) else b"")
    f.seek(end)
    try:
        header = json.loads(raw)
    except ValueError:
        raise BadBlock("unreadable header") from None
    if not isinstance(header, dict):
        raise BadBlock("unreadable header")
    header["_data_offset"] = _PREFIX.size + header_len
    return header


def _array_bytes(entry: dict) -> int:
    return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(STORED_DTYPES[entry["dtype"]]).itemsize


def open_block(path: Path) -> BinaryIO:
    """A block file opened for reading: a regular file only, never through a symlink, never waiting on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadBlock("not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: Path, fingerprint: str, key: bytes, layout: str = "") -> dict:
    """The validated header of the block file at `path` (see the module docstring)."""
    with open_block(path) as f:
        return _checked_header(f, fingerprint, key, layout)


def _checked_header(f: BinaryIO, fingerprint: str, key: bytes, layout: str) -> dict:
    header = _parse_prefix(f)
    size = os.fstat(f.fileno()).st_size
    try:
        if header["fingerprint"] != fingerprint:
            raise BadBlock("written for another model")
        if header["layout"] != layout:
            raise BadBlock(f"written for another cache layout ({header['layout']!r}, this worker has {layout!r})")
        if header["key"] != key.hex():
            raise BadBlock("key does not match the file name")
        for entry in header["arrays"]:
            if entry["dtype"] not in STORED_DTYPES:
                raise BadBlock(f"unknown dtype {entry['dtype']!r}")
        if sum(_array_bytes(e) for e in header["arrays"]) != int(header["payload_bytes"]):
            raise BadBlock("the arrays do not add up to the payload")
        announced = header["_data_offset"] + int(header["payload_bytes"])
        if size != announced:
            raise BadBlock(f"{size} bytes on disk, the header announces {announced}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadBlock):
            raise
        raise BadBlock(f"incomplete header: {exc}") from None
    return header


def read_block(path: Path, fingerprint: str, key: bytes, tokens: tuple[int, ...], layout: str = "",
               snapshot: bool = True) -> BlockData:
    """Read and verify a block; its tokens must be `tokens` (a guard against collisions).

    With `snapshot` False a snapshot's arrays are skipped, unread (the block comes without one).
    """
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    with open_block(path) as f:
        header = _checked_header(f, fingerprint, key, layout)
        if tuple(header.get("tokens", ())) != tokens:
            raise BadBlock("holds other tokens")
        try:
            wanted = [snapshot or not e["name"].startswith(SNAPSHOT_PREFIX) for e in header["arrays"]]
            sizes = [_array_bytes(e) for e in header["arrays"]]
            used = sum(sizes[:max((i + 1 for i, w in enumerate(wanted) if w), default=0)])
            payload = memoryview(f.read(used))  # one read: the arrays it uses lie first (a snapshot's after the K/V)
            if len(payload) != used:
                raise BadBlock("truncated payload")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, BadBlock):
                raise
            raise BadBlock(f"payload does not match the header: {exc}") from None
    try:
        offset = 0
        for entry, n, want in zip(header["arrays"], sizes, wanted, strict=True):
            if want:
                name, raw = entry["name"], payload[offset:offset + n]
                if zlib.crc32(raw) != entry["crc32"]:
                    raise BadBlock(f"checksum mismatch in {name}")
                arrays[name] = np.frombuffer(raw, STORED_DTYPES[entry["dtype"]]).reshape(entry["shape"])
                dtypes[name] = entry["dtype"]
            offset += n
        meta = header["snapshot"] if snapshot else None
        return BlockData(key, bytes.fromhex(header["parent"]), int(header["depth"]), tokens, arrays, dtypes, meta,
                         bool(header.get("tail", False)))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadBlock):
            raise
        raise BadBlock(f"payload does not match the header: {exc}") from None
