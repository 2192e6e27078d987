"""The SSD cache: KV blocks as files in one directory per model fingerprint, written in the background.

Layout: `<dir>/<key hex>.kvb`, one block per file (format in worker/ssd_format.py). The index
(key -> file size, least recently used first) lives in memory and is rebuilt at start-up from
the directory, in file-modification order; files that are not complete, intact blocks of this
model (other format version or fingerprint, truncated, garbage) and leftover temp files are
removed then. A block's payload is verified (CRC-32) again when it is read; a bad one is a
miss, and its file goes.

Writes: the main thread hands over numpy arrays of a chain's new blocks (`enqueue`), never MLX
arrays (they may be views of evaluated MLX arrays, which it keeps alive until `writing` says
they are done: worker/mlx_engine/disk_handoff.py); one writer thread writes each to a temp file, fsyncs it and renames it into place, so
a block file is either absent or complete, also after SIGKILL. The queue is bounded in bytes:
when it is full, the tail of a chain is dropped (its head, the useful part, goes first). A
size cap is kept by evicting the least recently used files; chains are touched deepest block
first so heads outlive tails, as in the hot cache. A prefix can be pinned for a while (`pin`: a
`cache_control` breakpoint or a `prompt_cache_key`, and its ttl), as in the hot cache: the cap passes over
its blocks while unpinned ones are left to take, so a marked prefix outlives a burst here too and is still on
disk for a worker that restarts mid-session. Pins are by key (a block pinned before it is written is kept once
it is) and live in memory only: a restarted worker has none until the client's next request pins again.

A finished sequence's partial last block (a tail: fewer tokens than a block, under a key no chain walk
reaches) is indexed by its parent as well, with its tokens in memory, so that a prompt which ends inside a
block finds the tail that starts the same way (`best_tail`) without a read, as in the hot cache.

Blocks of models with snapshot layers may carry a snapshot (worker/mlx_engine/layer_state.py);
the index knows which do, so a lookup reads only the one snapshot it uses, and a block first
written without a snapshot is written again when one comes for it.

Privacy: a block's header holds its prompt's token ids, so the directory (and any parent made for it) is
created 0700 and an existing one narrowed to it, and files are created 0600. Temp files have random names
and are opened O_CREAT|O_EXCL|O_NOFOLLOW, so a symlink planted at a would-be name is never written
through; the rebuild reads only regular files (a symlink or FIFO named *.kvb is removed unread).

Failure: an unwritable directory or a failed write (full disk) turns the SSD cache off with
a warning; serving goes on with the hot cache. `clear` bumps an epoch so that a write already
under way is discarded rather than indexed. `close` lets the writer finish the queue, joins
it within a deadline and abandons what is left after it.

Thread rules: `_lock` guards the index, queue, epoch and `enabled`; file I/O happens outside it.
Reads of a hit's blocks run on a small pool of reader threads, in parallel (numpy only, like the writer).

Why one module of over 400 lines: the index, the writer thread, the readers, the cap and `clear` all hold
`_lock` over the same index, queue and epoch; apart, they would share that private state across modules.
The file format is already its own module (ssd_format.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from protocol.cachedir import BLOCK_SUFFIX, TEMP_SUFFIX, private_dir
from worker.faults import Faults
from worker.ssd_format import BadBlock, BlockData, read_block, read_header, write_block

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 256 * 2**20
READERS = max(2, min(8, os.cpu_count() or 2))  # threads that read and check a hit's blocks at once
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_name(final: Path) -> Path:
    """A temp file's name beside `final`: random, so no other user can plant something there beforehand."""
    return final.with_name(f"{final.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")


def create_private(path: Path) -> int:
    """A new file, 0600, opened for writing; fails if anything (a symlink included) is at `path` already."""
    return os.open(path, _CREATE, 0o600)


@dataclass(slots=True)
class _Job:
    epoch: int
    blocks: list[BlockData]
    nbytes: int


class SsdCache:
    def __init__(self, directory: Path, fingerprint: str, cap_bytes: int, model_id: str = "",
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, faults: Iterable[str] = (), layout: str = "") -> None:
        self.dir = directory
        self.fingerprint = fingerprint
        self.layout = layout  # the model's cache layout id: files written under another are dropped
        self.cap = cap_bytes
        self.model_id = model_id
        self.queue_bytes = queue_bytes
        self.faults = Faults(faults)  # testing only (worker/faults.py): a full disk, a slow or a stalled writer
        self.enabled = False
        self.error: str | None = None
        self.nbytes = 0
        self.dropped_blocks = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._snapshots: set[bytes] = set()  # indexed keys whose file carries a snapshot
        self._tails: dict[bytes, dict[bytes, tuple[int, ...]]] = {}  # parent -> indexed tails under it: their tokens
        self._tail_parent: dict[bytes, bytes] = {}  # an indexed tail's key -> its parent
        self._pins: dict[bytes, float] = {}  # key -> time.monotonic() deadline of its pin
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: deque[_Job] = deque()
        self._queued_bytes = 0
        self._pending: set[bytes] = set()
        self._pending_snapshots: set[bytes] = set()
        self._epoch = 0
        self._closing = False
        self._abandon = False
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        try:
            private_dir(self.dir)
            probe = temp_name(self.dir / ".probe")
            os.close(create_private(probe))
            probe.unlink()
        except OSError as exc:
            self._disable(f"cache directory {self.dir} is not writable: {exc}")
            return
        self.enabled = True
        try:
            self._rebuild()
        except OSError as exc:
            self._disable(f"cache directory {self.dir} is not readable: {exc}")
            return
        self._thread = threading.Thread(target=self._run, name="ssd-cache-writer", daemon=True)
        self._thread.start()

    # --- state shared with the writer --------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def has(self, key: bytes, snapshot: bool = False) -> bool:
        """Whether the block is on disk or on its way there (with a snapshot, when `snapshot`)."""
        with self._lock:
            if snapshot:
                return key in self._snapshots or key in self._pending_snapshots
            return key in self._index or key in self._pending

    def writing(self, keys: list[bytes]) -> bool:
        """Whether any of these blocks is still queued or being written (the writer may read its arrays)."""
        with self._lock:
            return any(key in self._pending for key in keys)

    def present(self, keys: list[bytes]) -> list[bool]:
        """For the longest prefix of `keys` on disk: whether each of its blocks carries a snapshot."""
        found = []
        with self._lock:
            for key in keys:
                if key not in self._index:
                    break
                found.append(key in self._snapshots)
        return found

    def pin(self, keys: list[bytes], ttl_s: float) -> None:
        """Keep these blocks ahead of unpinned ones for `ttl_s` seconds from now (a later pin only extends)."""
        now = time.monotonic()
        with self._lock:
            self._pins = {k: t for k, t in self._pins.items() if t > now}  # the expired go: the dict stays small
            for key in keys:
                self._pins[key] = max(self._pins.get(key, 0.0), now + ttl_s)

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{BLOCK_SUFFIX}"

    def _disable(self, reason: str) -> None:
        with self._lock:
            if self.error is None:
                log.warning("[cache] model=%s ssd=off reason=%r (serving goes on with the hot cache)",
                            self.model_id, reason)
            self.enabled = False
            self.error = reason
            self._drop_queue()
            self._wake.notify_all()

    def _drop_queue(self) -> None:
        """Forget the jobs not yet started (with `_lock` held); the one under way settles itself."""
        for job in self._jobs:
            self._queued_bytes -= job.nbytes
            self._pending.difference_update(b.key for b in job.blocks)
            self._pending_snapshots.difference_update(b.key for b in job.blocks)
        self._jobs.clear()

    # --- start-up ----------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the directory's complete blocks, oldest first; remove everything else."""
        t0 = time.monotonic()
        found: list[tuple[int, bytes, int, bool, tuple[bytes, tuple[int, ...]] | None]] = []
        removed = 0
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(TEMP_SUFFIX):
                removed += self._remove(Path(entry.path))
                continue
            if not name.endswith(BLOCK_SUFFIX):
                continue
            if not entry.is_file(follow_symlinks=False):  # a symlink or FIFO: never opened, never followed
                log.info("[cache] model=%s ssd=rebuild removed=%s reason='not a regular file'", self.model_id, name)
                removed += self._remove(Path(entry.path))
                continue
            try:
                key = bytes.fromhex(name[: -len(BLOCK_SUFFIX)])
                header = read_header(Path(entry.path), self.fingerprint, key, self.layout)
                st = entry.stat(follow_symlinks=False)
            except (ValueError, OSError) as exc:  # BadBlock is a ValueError
                log.info("[cache] model=%s ssd=rebuild removed=%s reason=%r", self.model_id, name, str(exc))
                removed += self._remove(Path(entry.path))
                continue
            tail = (bytes.fromhex(header["parent"]), tuple(header["tokens"])) if header.get("tail") else None
            found.append((st.st_mtime_ns, key, st.st_size, header["snapshot"] is not None, tail))
        for _, key, size, snapshot, tail in sorted(found, key=lambda f: f[0]):
            self._index[key] = size
            self.nbytes += size
            if snapshot:
                self._snapshots.add(key)
            if tail is not None:
                self._index_tail(key, *tail)
        self._evict_to_cap()
        log.info("[cache] model=%s ssd=rebuild dir=%s entries=%d bytes=%d removed=%d s=%.3f", self.model_id,
                 self.dir, len(self._index), self.nbytes, removed, time.monotonic() - t0)

    @staticmethod
    def _remove(path: Path) -> int:
        try:
            path.unlink()
            return 1
        except OSError:
            return 0

    # --- reads (main thread) -----------------------------------------------------------

    def load_chain(self, keys: list[bytes], tokens: list[tuple[int, ...]],
                   snapshot_at: int | None = None) -> list[BlockData]:
        """The blocks of the longest prefix of `keys` on disk, verified, touched as used; only the
        block at index `snapshot_at` (if any) comes with its snapshot."""
        return list(self.read_chain(keys, tokens, snapshot_at))

    def read_chain(self, keys: list[bytes], tokens: list[tuple[int, ...]],
                   snapshot_at: int | None = None) -> Iterator[BlockData]:
        """`load_chain`'s blocks one by one, root first, each as soon as it is read: the caller's work on a block
        overlaps the reads of the ones after it. The chain is touched once the caller is done with it.

        The blocks are read and checked by a pool of reader threads at once (file reads and zlib's
        CRC-32 let go of the GIL): a hit's cost is the disk's and memory's speed, not one core's CRC.
        """
        with self._lock:
            n = 0
            while n < min(len(keys), len(tokens)) and self.enabled and keys[n] in self._index:
                n += 1
        if n == 0:
            return
        pool = self._readers()
        reads = [pool.submit(read_block, self.path(keys[i]), self.fingerprint, keys[i], tokens[i], self.layout,
                             i == snapshot_at) for i in range(n)]
        found: list[bytes] = []
        try:
            for key, read in zip(keys, reads):
                try:
                    block = read.result()
                except (OSError, BadBlock) as exc:
                    log.warning("[cache] model=%s ssd=read dropped=%s reason=%r", self.model_id, key.hex(), str(exc))
                    self._forget(key, unlink=not isinstance(exc, FileNotFoundError))
                    break
                found.append(key)
                yield block
        finally:
            for later in reads:
                later.cancel()
            self._touch(found)

    def best_tail(self, parent: bytes, tokens: list[int]) -> tuple[bytes | None, tuple[int, ...], int]:
        """The indexed tail under `parent` whose tokens start with the longest run of `tokens`: (its key, its tokens,
        that run's length); (None, (), 0) when none shares a first token. Nothing is read."""
        best: tuple[bytes | None, tuple[int, ...], int] = (None, (), 0)
        with self._lock:
            for key, held in self._tails.get(parent, {}).items():
                n = 0
                for a, b in zip(held, tokens):
                    if a != b:
                        break
                    n += 1
                if n > best[2]:
                    best = (key, held, n)
        return best

    def load_tail(self, key: bytes, tokens: tuple[int, ...]) -> BlockData | None:
        """The tail `key` (holding `tokens`, as `best_tail` said), verified and touched; None if it is gone or bad."""
        try:
            data = read_block(self.path(key), self.fingerprint, key, tokens, self.layout)
        except (OSError, BadBlock) as exc:
            log.warning("[cache] model=%s ssd=read dropped=%s reason=%r", self.model_id, key.hex(), str(exc))
            self._forget(key, unlink=not isinstance(exc, FileNotFoundError))
            return None
        self._touch([key])
        return data

    def _readers(self) -> ThreadPoolExecutor:
        """The reader threads, started at the first read; `close` ends them."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="ssd-cache-reader")
            return self._pool

    def _forget(self, key: bytes, unlink: bool) -> None:
        with self._lock:
            self._unindex(key)
        if unlink:
            self._remove(self.path(key))

    def _touch(self, keys: list[bytes]) -> None:
        """Mark a chain used: in the index and in the files' mtimes, the root the most recent."""
        now = time.time_ns()
        with self._lock:
            for key in reversed(keys):
                if key in self._index:
                    self._index.move_to_end(key)
        for i, key in enumerate(keys):
            try:
                os.utime(self.path(key), ns=(now - i, now - i))
            except OSError:
                pass

    # --- writes ------------------------------------------------------------------------

    def enqueue(self, blocks: list[BlockData]) -> int:
        """Queue a chain's blocks (root side first) for writing; return how many were taken."""
        with self._lock:
            if not self.enabled or self._closing:
                return 0
            taken, nbytes = [], 0
            for b in blocks:
                known = b.key in self._index or b.key in self._pending
                upgrade = b.snapshot is not None and not (b.key in self._snapshots or b.key in self._pending_snapshots)
                if known and not upgrade:
                    continue
                if self._queued_bytes + nbytes + b.nbytes > self.queue_bytes or b.nbytes > self.cap:
                    self.dropped_blocks += 1
                    break  # the rest of the chain is useless without this block
                taken.append(b)
                nbytes += b.nbytes
            if taken:
                self._jobs.append(_Job(self._epoch, taken, nbytes))
                self._queued_bytes += nbytes
                self._pending.update(b.key for b in taken)
                self._pending_snapshots.update(b.key for b in taken if b.snapshot is not None)
                self._wake.notify()
            return len(taken)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closing:
                    self._wake.wait()
                if not self._jobs or self._abandon:
                    return
                job = self._jobs.popleft()
            try:
                self._write_job(job)
            except OSError as exc:
                self._disable(f"writing to {self.dir} failed: {exc}")
            except Exception as exc:  # a bug must not kill serving: the SSD tier goes off instead
                log.exception("[cache] model=%s ssd=writer failed", self.model_id)
                self._disable(f"the writer failed: {exc}")
            finally:
                nbytes, keys = job.nbytes, [b.key for b in job.blocks]
                del job  # its arrays may be views of the main thread's: let go of them before `writing` says so
                with self._lock:
                    self._queued_bytes -= nbytes
                    self._pending.difference_update(keys)
                    self._pending_snapshots.difference_update(keys)

    def _write_job(self, job: _Job) -> None:
        written: list[bytes] = []
        for block in job.blocks:
            if self._abandon:
                break
            final = self.path(block.key)
            tmp = temp_name(final)
            try:
                size = self._write_file(tmp, block)
                os.replace(tmp, final)
            except BaseException:
                self._remove(tmp)
                raise
            with self._lock:
                keep = self.enabled and job.epoch == self._epoch
                victims: list[bytes] = []
                if keep:
                    self.nbytes += size - self._index.get(block.key, 0)  # a block written again: its snapshot came
                    self._index[block.key] = size
                    if block.snapshot is not None:
                        self._snapshots.add(block.key)
                    if block.tail:
                        self._index_tail(block.key, block.parent, block.tokens)
                    victims = self._over_cap()  # in the same hold of the lock: nbytes is never seen over the cap
            for key in victims:
                self._remove(self.path(key))
            if not keep:  # cleared (or turned off) while this block was being written
                self._remove(final)
                return
            written.append(block.key)
        self._touch(written)

    def _write_file(self, tmp: Path, block: BlockData) -> int:
        self.faults.before_ssd_write()
        with os.fdopen(create_private(tmp), "wb") as f:
            self.faults.during_ssd_write(f, block.nbytes, block.depth, tmp.name)
            size = write_block(f, block, self.fingerprint, self.layout)
            f.flush()
            os.fsync(f.fileno())
        return size

    def _evict_to_cap(self) -> None:
        with self._lock:
            victims = self._over_cap()
        for key in victims:
            self._remove(self.path(key))

    def _over_cap(self) -> list[bytes]:
        """Drop the least recently used entries down to the cap (with `_lock` held); their files are the caller's.
        Pinned entries are passed over (sent to the recent end) while unpinned ones are left; then they go too."""
        victims: list[bytes] = []
        now, passed = time.monotonic(), 0
        while self.nbytes > self.cap and self._index:
            key = next(iter(self._index))
            if passed < len(self._index) and self._pins.get(key, 0.0) > now:
                self._index.move_to_end(key)
                passed += 1
                continue
            self._unindex(key)
            victims.append(key)
        return victims

    def _unindex(self, key: bytes) -> None:
        """Forget an entry (with `_lock` held): its size, its snapshot, its place among its parent's tails."""
        size = self._index.pop(key, None)
        if size is not None:
            self.nbytes -= size
        self._snapshots.discard(key)
        parent = self._tail_parent.pop(key, None)
        if parent is not None:
            tails = self._tails[parent]
            del tails[key]
            if not tails:
                del self._tails[parent]

    def _index_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Know a tail by its parent (with `_lock` held, or before the writer starts)."""
        self._tails.setdefault(parent, {})[key] = tokens
        self._tail_parent[key] = parent

    def usage(self) -> tuple[int, int]:
        """(entries, bytes), read together."""
        with self._lock:
            return len(self._index), self.nbytes

    # --- admin and teardown --------------------------------------------------------------

    def clear(self) -> tuple[int, int]:
        """Remove every block; return (blocks, bytes) reclaimed on disk."""
        with self._lock:
            self._epoch += 1  # a block under way is discarded when it lands
            self._drop_queue()
            keys = list(self._index)
            self._index.clear()
            self._snapshots.clear()
            self._tails.clear()
            self._tail_parent.clear()
            self._pins.clear()
            self.nbytes = 0
        entries = reclaimed = 0
        for key in keys:
            path = self.path(key)
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:
                continue
            entries += 1
            reclaimed += size
        return entries, reclaimed

    def close(self, deadline_s: float) -> None:
        """Let the writer finish what is queued, within `deadline_s`; abandon the rest."""
        with self._lock:
            self._closing = True
            queued = len(self._pending)
            self._wake.notify_all()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None:
            return
        t0 = time.monotonic()
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            self._abandon = True
            log.warning("[cache] model=%s ssd=close deadline_s=%.1f abandoned_blocks=%d (the writer did not finish)",
                        self.model_id, deadline_s, len(self._pending))
        else:
            log.info("[cache] model=%s ssd=close flushed_blocks=%d s=%.3f", self.model_id, queued,
                     time.monotonic() - t0)
