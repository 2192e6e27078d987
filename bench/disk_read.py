"""Disk reads that miss the page cache: the host's sequential read bandwidth, and files pushed out of the cache.

`sequential_read_gbs(directory)` writes a fresh file of `size_mib` MiB there (incompressible bytes), fsyncs it,
drops its pages from the page cache and times reading it back in large sequential reads: what the disk gives
the SSD cache's directory, not what memory gives. `drop_from_page_cache(paths)` drops the pages of files
already written (the SSD cache's blocks, fsynced by its writer), so that a hit on them reads from the disk.

How the pages are dropped is said in `METHOD`: `posix_fadvise(POSIX_FADV_DONTNEED)` after fsync on Linux
(clean pages go at once); on macOS `F_NOCACHE` on the descriptors that write and read (the page cache is
bypassed, not emptied); elsewhere nothing, which the method says.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

F_NOCACHE = 48  # macOS fcntl: reads and writes on this descriptor bypass the unified buffer cache
CHUNK = 8 * 2**20

if hasattr(os, "posix_fadvise"):
    METHOD = "fsync + posix_fadvise(POSIX_FADV_DONTNEED)"
elif sys.platform == "darwin":
    METHOD = "fcntl(F_NOCACHE) on write and read"
else:
    METHOD = "none (the page cache may serve the reads)"


def _no_cache(fd: int) -> None:
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, F_NOCACHE, 1)


def _drop(fd: int) -> None:
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def drop_from_page_cache(paths: Iterable[Path]) -> int:
    """Drop each file's pages from the page cache (see METHOD); the bytes of the files dropped."""
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile (the cap evicted it): nothing to drop
        try:
            _drop(fd)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def sequential_read_gbs(directory: Path, size_mib: int = 512, rounds: int = 3) -> dict:
    """The disk's sequential read bandwidth under `directory` (GB/s, 1e9 bytes), the median of `rounds` reads of one
    freshly written `size_mib` MiB file with its pages dropped before each."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".read-bandwidth-{os.getpid()}"
    size = size_mib * 2**20
    block = os.urandom(CHUNK)  # incompressible: no filesystem or device compression flatters the figure
    times = []
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _no_cache(fd)
            for _ in range(size // CHUNK):
                os.write(fd, block)
            _drop(fd)
        finally:
            os.close(fd)
        for _ in range(rounds):
            fd = os.open(path, os.O_RDONLY)
            try:
                _no_cache(fd)
                _drop(fd)
                buf = bytearray(CHUNK)
                view = memoryview(buf)
                t0, got = time.perf_counter(), 0
                while (n := os.readv(fd, [view])) > 0:
                    got += n
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    times.sort()
    median_s = times[len(times) // 2]
    return {"gbs": round(size / median_s / 1e9, 3), "gbs_rounds": [round(size / t / 1e9, 3) for t in times],
            "file_mib": size_mib, "read_chunk_mib": CHUNK // 2**20, "method": METHOD, "directory": str(directory)}
