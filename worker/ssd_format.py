"""The SSD cache's file format: one KV block per file, versioned, tied to one model fingerprint.

    offset 0   8 bytes   magic b"MLXSUPKV"
    offset 8   u32 LE    FORMAT_VERSION
    offset 12  u32 LE    header length H
    offset 16  H bytes   header, UTF-8 JSON: fingerprint, key, parent, depth, tokens, dtype,
                         k_shape, v_shape, payload_bytes, crc32
    16 + H     payload   the keys' bytes then the values' bytes, C order, nothing else

A block is exactly `block_tokens` tokens, so the payload is only the used part of the KV
buffers. bfloat16 travels as its raw 16-bit pattern (numpy has no bfloat16). No pickle: the
header is JSON and the payload raw bytes.

`read_header` checks what is cheap to check at start-up (magic, version, fingerprint, key and
the file's size against the header: a partial file fails it); `read_block` also checks the
payload's CRC-32 before anything is used. Both raise BadBlock on anything wrong.

Pure numpy and the standard library: the writer thread uses this, and it must not touch MLX.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"MLXSUPKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
MAX_HEADER_BYTES = 1 << 20

# The dtypes a block may hold: name -> the numpy dtype its bytes are stored as.
STORED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class BadBlock(ValueError):
    """A file that is not a complete, intact block of this format, model and key."""


@dataclass(slots=True)
class BlockData:
    """A block as plain numpy, for the writer thread and from the disk."""

    key: bytes
    parent: bytes
    depth: int
    tokens: tuple[int, ...]
    dtype: str
    keys: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _bytes_of(a: np.ndarray) -> memoryview:
    """The array's bytes in C order, without a copy when it is contiguous already."""
    return np.ascontiguousarray(a).data.cast("B")


def _header(block: BlockData, fingerprint: str) -> bytes:
    crc = zlib.crc32(_bytes_of(block.values), zlib.crc32(_bytes_of(block.keys)))
    return json.dumps({
        "fingerprint": fingerprint, "key": block.key.hex(), "parent": block.parent.hex(), "depth": block.depth,
        "tokens": list(block.tokens), "dtype": block.dtype, "k_shape": list(block.keys.shape),
        "v_shape": list(block.values.shape), "payload_bytes": block.nbytes, "crc32": crc,
    }, separators=(",", ":")).encode()


def write_block(f: BinaryIO, block: BlockData, fingerprint: str) -> int:
    """Write `block` to an open file; return the bytes written."""
    header = _header(block, fingerprint)
    f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)))
    f.write(header)
    f.write(_bytes_of(block.keys))
    f.write(_bytes_of(block.values))
    return _PREFIX.size + len(header) + block.nbytes


def _parse_prefix(f: BinaryIO) -> dict:
    raw = f.read(_PREFIX.size)
    if len(raw) != _PREFIX.size:
        raise BadBlock("truncated before the header")
    magic, version, header_len = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise BadBlock("not a KV block file")
    if version != FORMAT_VERSION:
        raise BadBlock(f"format version {version}, this worker reads {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise BadBlock("header too large")
    try:
        header = json.loads(f.read(header_len))
    except ValueError:
        raise BadBlock("unreadable header") from None
    if not isinstance(header, dict):
        raise BadBlock("unreadable header")
    header["_data_offset"] = _PREFIX.size + header_len
    return header


def read_header(path: Path, fingerprint: str, key: bytes) -> dict:
    """The validated header of the block file at `path` (see the module docstring)."""
    with open(path, "rb") as f:
        header = _parse_prefix(f)
        size = f.seek(0, 2)
    try:
        if header["fingerprint"] != fingerprint:
            raise BadBlock("written for another model")
        if header["key"] != key.hex():
            raise BadBlock("key does not match the file name")
        if header["dtype"] not in STORED_DTYPES:
            raise BadBlock(f"unknown dtype {header['dtype']!r}")
        announced = header["_data_offset"] + int(header["payload_bytes"])
        if size != announced:
            raise BadBlock(f"{size} bytes on disk, the header announces {announced}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadBlock):
            raise
        raise BadBlock(f"incomplete header: {exc}") from None
    return header


def read_block(path: Path, fingerprint: str, key: bytes, tokens: tuple[int, ...]) -> BlockData:
    """Read and verify a whole block; its tokens must be `tokens` (a guard against collisions)."""
    header = read_header(path, fingerprint, key)
    if tuple(header.get("tokens", ())) != tokens:
        raise BadBlock("holds other tokens")
    stored = STORED_DTYPES[header["dtype"]]
    with open(path, "rb") as f:
        f.seek(header["_data_offset"])
        payload = f.read()
    if zlib.crc32(payload) != header.get("crc32"):
        raise BadBlock("payload checksum mismatch")
    try:
        k_shape, v_shape = tuple(header["k_shape"]), tuple(header["v_shape"])
        k_bytes = int(np.prod(k_shape)) * np.dtype(stored).itemsize
        keys = np.frombuffer(payload, stored, count=int(np.prod(k_shape))).reshape(k_shape)
        values = np.frombuffer(payload, stored, offset=k_bytes).reshape(v_shape)
        return BlockData(key, bytes.fromhex(header["parent"]), int(header["depth"]), tokens, header["dtype"],
                         keys, values)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadBlock(f"payload does not match the header: {exc}") from None
