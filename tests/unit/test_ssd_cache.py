"""The SSD cache without MLX: its file format, the writer thread, the index rebuild, the cap, clear and close.

Blocks here are plain numpy (what the worker's main thread hands the writer); the real files,
thread and fsync are used.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from protocol.cachedir import clear_dir, model_cache_dir, model_fingerprint
from tests.conftest import wait_for
from worker import ssd_cache
from worker.ssd_cache import SsdCache
from worker.ssd_format import BadBlock, BlockData, read_block, read_header, write_block

FP = "f" * 24


def chain(n: int, seed: int = 0, dtype: str = "float32", tokens: int = 4,
          snapshot_at: tuple[int, ...] = ()) -> list[BlockData]:
    """Blocks as the worker hands them over: K/V arrays, and a recurrent-state snapshot on the blocks `snapshot_at`."""
    rng = np.random.default_rng(seed)
    stored = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    blocks, parent = [], b"\0" * 16
    for i in range(n):
        key = bytes([seed, i]) + b"k" * 14
        toks = tuple(int(t) for t in rng.integers(0, 1000, tokens))
        arrays = {name: rng.integers(0, 2**15, (2, 2, tokens, 8)).astype(stored) for name in ("kv:k", "kv:v")}
        dtypes = dict.fromkeys(arrays, dtype)
        meta = None
        if i in snapshot_at:
            arrays["snap:0.0.0"] = np.full((1, 3, 4), i, np.float32)
            dtypes["snap:0.0.0"] = "float32"
            meta = {"classes": ["ArraysCache"], "paths": ["0.0.0", "0.1", "0.2"], "scalars": {"0.1": None, "0.2": None}}
        blocks.append(BlockData(key, parent, i, toks, arrays, dtypes, meta))
        parent = key
    return blocks


def write(directory: Path, block: BlockData, fingerprint: str = FP, layout: str = "") -> Path:
    path = directory / f"{block.key.hex()}.kvb"
    with open(path, "wb") as f:
        write_block(f, block, fingerprint, layout)
    return path


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_format_round_trip_holds_only_the_block(tmp_path: Path, dtype: str) -> None:
    block = chain(1, dtype=dtype)[0]
    path = write(tmp_path, block)
    header = read_header(path, FP, block.key)
    assert path.stat().st_size == header["_data_offset"] + block.nbytes  # the payload is the used part only
    got = read_block(path, FP, block.key, block.tokens)
    assert got.dtypes == block.dtypes and got.depth == 0 and got.parent == block.parent
    assert got.arrays.keys() == block.arrays.keys()
    assert all(np.array_equal(got.arrays[n], block.arrays[n]) for n in block.arrays)
    assert got.snapshot is None


def test_format_carries_a_snapshot_and_can_leave_it_unread(tmp_path: Path) -> None:
    block = chain(1, snapshot_at=(0,))[0]
    path = write(tmp_path, block, layout="L1")
    whole = read_block(path, FP, block.key, block.tokens, "L1")
    assert whole.snapshot == block.snapshot and np.array_equal(whole.arrays["snap:0.0.0"], block.arrays["snap:0.0.0"])
    kv_only = read_block(path, FP, block.key, block.tokens, "L1", snapshot=False)
    assert kv_only.snapshot is None and set(kv_only.arrays) == {"kv:k", "kv:v"}
    assert np.array_equal(kv_only.arrays["kv:v"], block.arrays["kv:v"])  # read past the skipped arrays correctly


def test_format_refuses_another_cache_layout(tmp_path: Path) -> None:
    """kv_bits or a model's cache classes changed: the file's arrays mean something else."""
    block = chain(1)[0]
    path = write(tmp_path, block, layout="L1")
    with pytest.raises(BadBlock, match="another cache layout"):
        read_header(path, FP, block.key, "L2")


def _damaged(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[-7:]
    elif how == "version":
        data[8] += 1
    elif how == "payload":
        data[-1] ^= 0xFF
    elif how == "v1":  # a version-1 file (keys and values only) left by an older worker
        data[8:12] = (1).to_bytes(4, "little")
    elif how == "garbage":
        data = bytearray(b"not a block at all")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, match", [("truncated", "bytes on disk"), ("version", "format version"), ("v1", "format version 1"),
                                        ("payload", "checksum"), ("garbage", "not a KV block")])
def test_format_refuses_damaged_files(tmp_path: Path, how: str, match: str) -> None:
    block = chain(1)[0]
    path = write(tmp_path, block)
    _damaged(path, how)
    with pytest.raises(BadBlock, match=match):
        read_block(path, FP, block.key, block.tokens)


def test_format_refuses_another_model_key_or_tokens(tmp_path: Path) -> None:
    block = chain(1)[0]
    path = write(tmp_path, block)
    with pytest.raises(BadBlock, match="another model"):
        read_header(path, "0" * 24, block.key)
    with pytest.raises(BadBlock, match="key"):
        read_header(path, FP, b"x" * 16)
    with pytest.raises(BadBlock, match="other tokens"):
        read_block(path, FP, block.key, tuple(t + 1 for t in block.tokens))


def test_writes_then_rebuild_keeps_complete_blocks_and_removes_the_rest(tmp_path: Path) -> None:
    ssd = SsdCache(tmp_path, FP, 1 << 30)
    blocks = chain(5)
    assert ssd.enqueue(blocks) == 5
    ssd.close(10)
    assert len(ssd) == 5 and ssd.nbytes == sum(p.stat().st_size for p in tmp_path.glob("*.kvb"))
    junk = {"truncated": blocks[3], "version": blocks[4]}
    for how, block in junk.items():
        _damaged(ssd.path(block.key), how)
    (tmp_path / f"{'ab' * 16}.kvb").write_bytes(b"garbage")
    (tmp_path / f"{blocks[0].key.hex()}.kvb.123.tmp").write_bytes(b"half a block")
    other = chain(1, seed=9)[0]
    write(tmp_path, other, fingerprint="0" * 24)

    again = SsdCache(tmp_path, FP, 1 << 30)
    assert len(again) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{b.key.hex()}.kvb" for b in blocks[:3])
    found = again.load_chain([b.key for b in blocks], [b.tokens for b in blocks])
    assert [b.key for b in found] == [b.key for b in blocks[:3]]
    again.close(1)


def test_the_index_knows_which_blocks_carry_snapshots_and_takes_one_that_was_missing(tmp_path: Path) -> None:
    """A block first written without a snapshot is written again when one comes for it; a rebuild keeps
    knowing which files carry one, and a lookup reads only the snapshot it asks for."""
    plain, with_snap = chain(3), chain(3, snapshot_at=(1, 2))
    ssd = SsdCache(tmp_path, FP, 1 << 30, layout="L1")
    ssd.enqueue(plain)
    wait_for(lambda: len(ssd) == 3, 10)
    assert ssd.present([b.key for b in plain]) == [False, False, False]
    assert ssd.has(plain[1].key) and not ssd.has(plain[1].key, snapshot=True)
    assert ssd.enqueue(with_snap) == 2  # blocks 1 and 2 again, now with their snapshots
    ssd.close(10)
    assert ssd.nbytes == sum(p.stat().st_size for p in tmp_path.glob("*.kvb"))

    again = SsdCache(tmp_path, FP, 1 << 30, layout="L1")
    keys = [b.key for b in plain]
    assert again.present(keys) == [False, True, True]
    found = again.load_chain(keys, [b.tokens for b in plain], snapshot_at=1)
    assert [b.snapshot is not None for b in found] == [False, True, False]
    again.close(1)
    other_layout = SsdCache(tmp_path, FP, 1 << 30, layout="L2")  # kv_bits changed: nothing is usable
    assert len(other_layout) == 0 and not list(tmp_path.glob("*.kvb"))
    other_layout.close(1)


def partial(parent: BlockData, tokens: tuple[int, ...], seed: int) -> BlockData:
    """A finished sequence's partial last block under `parent` (fewer tokens than a block)."""
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal((2, 2, len(tokens), 8)).astype(np.float32) for name in ("kv:k", "kv:v")}
    return BlockData(bytes([200, seed]) + b"t" * 14, parent.key, parent.depth + 1, tokens, arrays,
                     dict.fromkeys(arrays, "float32"), tail=True)


def test_tails_are_found_by_their_parent_across_a_rebuild_and_leave_with_their_files(tmp_path: Path) -> None:
    head = chain(2)
    short, long = partial(head[-1], (5, 6, 7), seed=1), partial(head[-1], (5, 6, 9, 9), seed=2)
    ssd = SsdCache(tmp_path, FP, 1 << 30)
    ssd.enqueue([*head, short])
    ssd.enqueue([long])
    wait_for(lambda: len(ssd) == 4, 10)
    assert ssd.best_tail(head[-1].key, [5, 6, 9, 1]) == (long.key, long.tokens, 3)
    assert ssd.best_tail(head[-1].key, [5, 6, 7, 1]) == (short.key, short.tokens, 3)
    assert ssd.best_tail(head[0].key, [5, 6, 7]) == (None, (), 0)  # found only under its own parent
    ssd.close(10)

    again = SsdCache(tmp_path, FP, 1 << 30)  # a restart: the tails are known from their headers
    assert again.best_tail(head[-1].key, [5, 6, 9]) == (long.key, long.tokens, 3)
    got = again.load_tail(long.key, long.tokens)
    assert got is not None and got.tail and np.array_equal(got.arrays["kv:v"], long.arrays["kv:v"])
    again.path(long.key).write_bytes(b"garbage")
    assert again.load_tail(long.key, long.tokens) is None  # a bad file is a miss, and the tail is forgotten
    assert again.best_tail(head[-1].key, [5, 6, 9]) == (short.key, short.tokens, 2)
    again.clear()
    assert again.best_tail(head[-1].key, [5, 6, 7]) == (None, (), 0)
    again.close(1)


def test_cap_evicts_least_recent_tails_first(tmp_path: Path) -> None:
    a, b = chain(3, seed=1), chain(3, seed=2)
    size = len(write(tmp_path, a[0]).read_bytes())
    (tmp_path / f"{a[0].key.hex()}.kvb").unlink()
    ssd = SsdCache(tmp_path, FP, cap_bytes=int(4.5 * size))  # room for 4 blocks
    ssd.enqueue(a)
    wait_for(lambda: len(ssd) == 3, 10)
    ssd.enqueue(b)
    ssd.close(10)
    assert ssd.nbytes <= 4.5 * size
    kept = {p.name for p in tmp_path.glob("*.kvb")}
    # chain a is older: its tail goes first, its root stays; the newer chain b is whole
    assert kept == {f"{x.key.hex()}.kvb" for x in [a[0], *b]}


def test_a_pinned_chain_outlives_newer_ones_and_a_restart_until_only_pins_are_left(tmp_path: Path) -> None:
    """A `cache_control` breakpoint's prefix (pinned before it is written) is passed over by the cap while unpinned
    blocks are left, so a worker that restarts after a burst still finds it on disk; the cap holds regardless."""
    a, burst = chain(3, seed=1), [chain(3, seed=s) for s in (2, 3, 4)]
    size = len(write(tmp_path, a[0]).read_bytes())
    (tmp_path / f"{a[0].key.hex()}.kvb").unlink()
    ssd = SsdCache(tmp_path, FP, cap_bytes=int(4.5 * size))  # room for 4 blocks
    ssd.pin([b.key for b in a], ttl_s=300)
    ssd.enqueue(a)
    wait_for(lambda: len(ssd) == 3, 10)
    for other in burst:
        ssd.enqueue(other)
    ssd.close(10)
    assert ssd.nbytes <= 4.5 * size
    kept = {p.name for p in tmp_path.glob("*.kvb")}
    assert {f"{x.key.hex()}.kvb" for x in a} <= kept, kept  # unpinned, the oldest chain went first
    again = SsdCache(tmp_path, FP, 1 << 30)  # the worker restarted: its pins are gone, the blocks are not
    assert [b.key for b in again.load_chain([b.key for b in a], [b.tokens for b in a])] == [b.key for b in a]
    again.close(1)

    small = SsdCache(tmp_path / "small", FP, cap_bytes=int(2.5 * size))
    small.pin([b.key for b in a], ttl_s=300)
    small.enqueue(a)
    small.close(10)
    assert small.nbytes <= 2.5 * size and len(small) == 2  # every block pinned: the cap still holds


def test_an_expired_ssd_pin_protects_nothing(tmp_path: Path) -> None:
    a, b = chain(3, seed=1), chain(3, seed=2)
    ssd = SsdCache(tmp_path, FP, cap_bytes=1 << 30)
    ssd.pin([x.key for x in a], ttl_s=-1)
    ssd.enqueue(a)
    wait_for(lambda: len(ssd) == 3, 10)
    ssd.cap = ssd.nbytes + 64  # room for 3 blocks (their headers differ by a byte or two)
    ssd.enqueue(b)
    ssd.close(10)
    assert not ssd.present([a[0].key]) and ssd.present([x.key for x in b]) == [False] * 3


def test_bounded_queue_drops_the_tail_of_a_chain(tmp_path: Path) -> None:
    blocks = chain(6)
    ssd = SsdCache(tmp_path, FP, 1 << 30, queue_bytes=3 * blocks[0].nbytes, faults=("ssd-slow",))
    taken = ssd.enqueue(blocks)
    assert taken == 3 and ssd.dropped_blocks == 1
    ssd.close(10)
    assert {p.name for p in tmp_path.glob("*.kvb")} == {f"{b.key.hex()}.kvb" for b in blocks[:3]}


def test_close_flushes_the_queue(tmp_path: Path) -> None:
    ssd = SsdCache(tmp_path, FP, 1 << 30, faults=("ssd-slow",))  # 0.25 s a block
    ssd.enqueue(chain(4))
    ssd.close(10)
    assert len(list(tmp_path.glob("*.kvb"))) == 4


def test_close_gives_up_at_its_deadline(tmp_path: Path) -> None:
    ssd = SsdCache(tmp_path, FP, 1 << 30, faults=("ssd-stall",))  # stalls forever in the block of depth 4
    ssd.enqueue(chain(6))
    wait_for(lambda: list(tmp_path.glob("*.tmp")), 10)
    t0 = time.monotonic()
    ssd.close(0.3)
    assert time.monotonic() - t0 < 2
    assert len(list(tmp_path.glob("*.kvb"))) == 4


def test_clear_reclaims_the_bytes_on_disk(tmp_path: Path) -> None:
    ssd = SsdCache(tmp_path, FP, 1 << 30)
    ssd.enqueue(chain(3))
    wait_for(lambda: len(ssd) == 3, 10)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.kvb"))
    assert ssd.clear() == (3, on_disk)
    assert len(ssd) == 0 and ssd.nbytes == 0 and not list(tmp_path.glob("*.kvb"))
    ssd.close(1)


def test_unwritable_directory_turns_it_off(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where a folder should be")
    ssd = SsdCache(tmp_path / "file" / "cache", FP, 1 << 30)
    assert not ssd.enabled and "not writable" in (ssd.error or "")
    assert ssd.enqueue(chain(1)) == 0
    assert ssd.load_chain([chain(1)[0].key], [chain(1)[0].tokens]) == []
    ssd.close(1)


def test_full_disk_turns_it_off(tmp_path: Path) -> None:
    ssd = SsdCache(tmp_path, FP, 1 << 30, faults=("ssd-enospc",))
    assert ssd.enabled
    ssd.enqueue(chain(2))
    wait_for(lambda: not ssd.enabled, 10)
    assert "No space left" in (ssd.error or "")
    assert ssd.enqueue(chain(2, seed=3)) == 0
    assert not list(tmp_path.iterdir())  # no temp file left behind
    ssd.close(1)


def test_model_directory_follows_the_weights(tmp_path: Path) -> None:
    def model(name: str, weights: bytes) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "tokenizer.json").write_text("{}")
        (d / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}" + weights)
        return d

    a, same, other = model("a", b"\1" * 4096), model("b", b"\1" * 4096), model("c", b"\2" * 4096)
    assert model_fingerprint(a) == model_fingerprint(same) != model_fingerprint(other)
    (same / "tokenizer.json").write_text('{"changed": true}')
    assert model_fingerprint(a) != model_fingerprint(same)
    d = model_cache_dir(tmp_path / "root", a)
    d.mkdir(parents=True)
    (d / "x.kvb").write_bytes(b"12345")
    (d / "y.kvb.1.tmp").write_bytes(b"12")
    (d / "keep.txt").write_bytes(b"1")
    assert clear_dir(d) == (1, 7)
    assert [p.name for p in d.iterdir()] == ["keep.txt"]


def _weights(d: Path, data: bytes, tensors: int = 8) -> Path:
    """A model folder whose safetensors file holds `data` as `tensors` F32 tensors."""
    import json
    import struct

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    step = len(data) // tensors
    header = json.dumps({f"t{i}": {"dtype": "F32", "shape": [step // 4], "data_offsets": [i * step, (i + 1) * step]}
                         for i in range(tensors)}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data[:step * tensors])
    return d


def _between_samples(size: int) -> int:
    """An offset in the middle of a file of `size` bytes that none of the old fingerprint's 16 samples of 64 KiB
    read (protocol/cachedir.py up to 2026-12: name, size, header and those samples)."""
    at = size * 8 // 16 + 64 * 1024 + (size // 16 - 64 * 1024) // 2
    assert all(not size * i // 16 <= at < size * i // 16 + 64 * 1024 for i in range(16))
    return at


def test_models_whose_weights_differ_anywhere_get_different_directories(tmp_path: Path) -> None:
    """Two 4 MiB models that differ in one tensor in the middle of the file, between two of the old samples, got
    one fingerprint: one SSD directory, each reading the other's K/V. Every byte counts now."""
    data = np.random.default_rng(0).integers(0, 256, 4 * 2**20, dtype=np.uint8).tobytes()
    a = _weights(tmp_path / "a", data)
    size = (a / "model.safetensors").stat().st_size
    at = _between_samples(size)
    changed = bytearray((a / "model.safetensors").read_bytes())
    changed[at] ^= 1  # the low bit of one float of one tensor
    b = _weights(tmp_path / "b", data)
    (b / "model.safetensors").write_bytes(bytes(changed))
    root = tmp_path / "cache"
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_cache_dir(root, a) != model_cache_dir(root, b)
    copy = _weights(tmp_path / "copy", data)  # the same bytes elsewhere: the same model, the same directory
    assert model_cache_dir(root, copy) == model_cache_dir(root, a)
    for offset in (8 + 3, size - 1):  # the header's last bytes, the file's last byte
        other = bytearray((a / "model.safetensors").read_bytes())
        other[offset] ^= 0x20
        (copy / "model.safetensors").write_bytes(bytes(other))
        assert model_cache_dir(root, copy) != model_cache_dir(root, a), offset


def test_a_weights_digest_is_kept_beside_the_cache_and_a_change_in_place_is_seen(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """A restart does not hash the weights again: each file's digest is kept under <root>/.fingerprints, keyed by
    its device, inode, size, mtime and ctime. A file rewritten in place, its mtime put back, is hashed again (its
    ctime moved); a digest is not kept for a file that changed while it was hashed."""
    from protocol import cachedir

    data = np.random.default_rng(1).integers(0, 256, 2**20, dtype=np.uint8).tobytes()
    a = _weights(tmp_path / "a", data)
    root = tmp_path / "cache"
    first = model_cache_dir(root, a)
    kept = list((root / cachedir.DIGESTS).iterdir())
    assert len(kept) == 1 and stat.S_IMODE(kept[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((root / cachedir.DIGESTS).stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) == 0o700

    hashed: list[Path] = []
    real = cachedir._hash_files
    monkeypatch.setattr(cachedir, "_hash_files", lambda paths: (hashed.extend(paths), real(paths))[1])
    assert model_cache_dir(root, a) == first and hashed == []  # from the kept digest
    assert model_fingerprint(a) == first.name and len(hashed) == 1  # no root: no digests kept, every byte read

    weights = a / "model.safetensors"
    before = weights.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(weights, "r+b") as f:  # rewritten in place, the same size ...
        f.seek(_between_samples(before.st_size))
        f.write(b"\xff\xfe")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... and its mtime put back
    assert weights.stat().st_mtime_ns == before.st_mtime_ns and weights.stat().st_ino == before.st_ino
    assert model_cache_dir(root, a) != first and len(hashed) == 2

    (root / cachedir.DIGESTS / kept[0].name).write_text("{not json")  # a damaged digest file: hashed again
    assert model_cache_dir(root, a) != first and len(hashed) == 3
    (tmp_path / "a-file").write_text("not a folder")  # a root that cannot be made: the digest is only not kept
    assert model_cache_dir(tmp_path / "a-file" / "cache", a).name == model_fingerprint(a)


def test_the_supervisor_finds_a_directory_from_kept_digests_alone(tmp_path: Path, monkeypatch) -> None:
    """Clearing every model's SSD cache must not read every byte of every model on disk: a model whose digests
    no worker kept has no blocks, and known_cache_dir says so without hashing."""
    from protocol import cachedir

    a = _weights(tmp_path / "a", bytes(range(256)) * 4096)
    root = tmp_path / "cache"
    monkeypatch.setattr(cachedir, "_hash_files", lambda paths: pytest.fail(f"hashed {paths}"))
    assert cachedir.known_cache_dir(root, a) is None
    monkeypatch.undo()
    directory = model_cache_dir(root, a)  # a worker's load: hashed, kept
    monkeypatch.setattr(cachedir, "_hash_files", lambda paths: pytest.fail(f"hashed {paths}"))
    assert cachedir.known_cache_dir(root, a) == directory


def test_the_old_fingerprints_directory_is_retired_once_the_new_one_is_found(tmp_path: Path) -> None:
    """An upgrade names every model's directory anew: the old one (which may have been shared with a model of
    other weights) is emptied and removed, so no cap's worth of unreachable blocks stays behind per model."""
    from protocol.cachedir import legacy_cache_dir, retire

    a = _weights(tmp_path / "a", bytes(range(256)) * 4096)
    root = tmp_path / "cache"
    old, new = legacy_cache_dir(root, a), model_cache_dir(root, a)
    assert old != new and old.parent == new.parent == root
    old.mkdir(parents=True)
    (old / "x.kvb").write_bytes(b"12345")
    (old / "y.kvb.1.tmp").write_bytes(b"12")
    assert retire(old, new) == (1, 7) and not old.exists()
    assert retire(old, new) == (0, 0) and retire(new, new) == (0, 0)


def test_a_damaged_block_mid_chain_ends_the_hit_there_and_goes(tmp_path: Path) -> None:
    # The chain's blocks are read at once by the reader pool; the hit is still the prefix before
    # the first bad block, whose file goes, and the blocks after it are not part of the hit.
    ssd = SsdCache(tmp_path, FP, 1 << 30)
    blocks = chain(6)
    assert ssd.enqueue(blocks) == 6
    ssd.close(10)
    again = SsdCache(tmp_path, FP, 1 << 30)
    _damaged(again.path(blocks[3].key), "payload")
    found = again.load_chain([b.key for b in blocks], [b.tokens for b in blocks])
    assert [b.key for b in found] == [b.key for b in blocks[:3]]
    assert [list(b.arrays) for b in found] == [list(b.arrays) for b in blocks[:3]]
    assert all(np.array_equal(f.arrays[n], b.arrays[n]) for f, b in zip(found, blocks) for n in b.arrays)
    assert not again.path(blocks[3].key).exists() and len(again) == 5
    again.close(10)
    assert again._pool is None


def test_the_directory_and_its_files_are_private_to_their_user(tmp_path: Path) -> None:
    """Block headers hold prompts' token ids: no other local user may list or read them."""
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    root = tmp_path / "kv" / "models"
    for directory in (root / "fp", wide):
        ssd = SsdCache(directory, FP, 1 << 30)
        assert ssd.enqueue(chain(2)) == 2
        ssd.close(10)
        assert len(ssd) == 2
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # made so, or an existing one narrowed
        assert [stat.S_IMODE(p.stat().st_mode) for p in directory.glob("*.kvb")] == [0o600, 0o600]
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700  # the parents it made, too
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_symlink_planted_at_a_temp_name_is_never_written_through(tmp_path: Path, monkeypatch) -> None:
    """A symlink at the temp name the writer is about to use (a pid-based one, or one an attacker guessed) must
    not have it overwrite the link's target."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "cache"
    directory.mkdir()
    block = chain(1)[0]
    guessed = directory / f"{block.key.hex()}.kvb.guessed.tmp"
    monkeypatch.setattr(ssd_cache, "temp_name", lambda final: guessed, raising=False)
    ssd = SsdCache(directory, FP, 1 << 30)
    for name in (guessed.name, f"{block.key.hex()}.kvb.{os.getpid()}.tmp"):
        (directory / name).symlink_to(victim)
    ssd.enqueue([block])
    ssd.close(10)
    assert victim.read_bytes() == b"precious"
    assert len(ssd) == 0 and not ssd.path(block.key).exists()


def test_temp_names_are_random() -> None:
    final = Path("/x") / "ab.kvb"
    names = {ssd_cache.temp_name(final).name for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("ab.kvb.") and n.endswith(".tmp") for n in names)


def test_rebuild_neither_follows_a_symlink_nor_waits_on_a_fifo(tmp_path: Path) -> None:
    """A *.kvb that is not a regular file is removed unread: a FIFO would block the open, a symlink leads out."""
    outside = tmp_path / "outside"
    outside.mkdir()
    block, fifo_block = chain(2)
    target = write(outside, block)  # a valid block, but not in the cache's directory
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / target.name).symlink_to(target)
    fifo = directory / f"{fifo_block.key.hex()}.kvb"
    os.mkfifo(fifo)
    done: list[SsdCache] = []
    builder = threading.Thread(target=lambda: done.append(SsdCache(directory, FP, 1 << 30)), daemon=True)
    builder.start()
    builder.join(30)
    if not done:  # unblock the open that hangs, so the thread and the test end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        builder.join(10)
    assert done, "the rebuild waited on a FIFO"
    ssd = done[0]
    assert len(ssd) == 0 and sorted(p.name for p in directory.iterdir()) == []
    assert target.exists()  # the link went, not what it pointed to
    ssd.close(1)
    os.mkfifo(fifo)
    with pytest.raises(BadBlock, match="regular"):  # a block read, as a hit does, refuses it too
        read_header(fifo, FP, fifo_block.key)
