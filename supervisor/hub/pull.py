"""Pull ORG/NAME[@REVISION] from the Hugging Face hub into its cache: only what an MLX model needs, checked first,
verified after, resumable, with progress.

A pull asks the hub's model info for the revision's files (sizes, LFS sha256, git blob ids), keeps what a
worker loads (config, tokenizer, chat template, safetensors and their index, processor files), refuses a repo
that is no MLX model (no safetensors; an architecture mlx-lm lacks, arch.py), checks the free space against
what is left to fetch, then downloads file by file into the cache's own layout (`blobs/<etag>`, linked from
`snapshots/<commit>/<name>`, `refs/<revision>`), as huggingface_hub writes it, so every tool shares the files.
The bytes come through huggingface_hub's own HTTP session (endpoint, HF_TOKEN, headers, retries), but not
through `hf_hub_download`: in huggingface_hub 2.x it writes each file to a temporary name of its process and
deletes it on failure, so a cut download could never be resumed by the next pull.
Invariants:
- A file is written to `blobs/<etag>.incomplete` and becomes a blob (and a snapshot link) only once its size
  and hash (sha256 for LFS files, the git blob id for the others) match the hub's: nothing partial or corrupt
  is ever linked into a snapshot. A wrong hash removes the download and fails the pull.
- The repo carries a pull mark (store.py) from before its first byte to after its last link, so a model
  being pulled, or whose pull was cut, is never offered for serving.
- An interrupted pull leaves its `.incomplete` file; the next pull resumes it with an HTTP Range request.
- One pull of a repo at a time: a mark of another live process refuses a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, BinaryIO

from supervisor.hub import store
from supervisor.hub.arch import unsupported

log = logging.getLogger(__name__)

# what a worker reads of a model folder; everything else in a repo (README, images, GGUF, PyTorch bins) is left
WANTED = ("*.json", "*.safetensors", "*.jinja", "*.tiktoken", "tokenizer.model", "spiece.model", "merges.txt",
          "vocab.txt", "1_Pooling/config.json")
# the hub's own rule for a repo id (huggingface_hub's validate_repo_id): ORG/NAME, each of letters, digits, '-', '_'
# and '.', neither starting nor ending with '-' or '.', no '--' or '..', at most 96 characters each
_PART = r"(?![.-])[\w.-]{1,96}(?<![.-])"
REPO_ID = re.compile(rf"^{_PART}/{_PART}$", re.ASCII)
# a revision: a branch, a tag, a commit, or a pull request's `refs/pr/N`: '/'-separated parts of letters, digits,
# '-', '_' and '.', none starting with '.', none ending in '.lock'; no '..'; at most 255 characters
_REV_PART = r"(?!\.)[\w.-]+(?<!\.lock)"
REVISION = re.compile(rf"^{_REV_PART}(?:/{_REV_PART})*$", re.ASCII)
MAX_REVISION = 255
ID_RULE = ("expected ORG/NAME[@REVISION]: ORG and NAME of letters, digits, '-', '_' and '.', at most 96 characters "
           "each, neither starting nor ending with '-' or '.', without '--' or '..'; REVISION a branch, tag or commit "
           f"(or refs/pr/N), at most {MAX_REVISION} characters of the same, '/' between parts, no '..'")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
PROGRESS_S = 0.2  # the most often progress is reported while bytes arrive
HASH_CHUNK = 1 << 20
RETRIES = 5  # cuts in a row without a byte between them before a file's download gives up


class PullError(Exception):
    """A pull that cannot go on; its message is one line for the user."""


class BadReference(PullError):
    """ORG/NAME[@REVISION] that breaks the hub's rules for ids (ID_RULE): the asker's to fix, before any request."""


class HubUnreachable(PullError):
    """The hub cannot be reached (no network, a wrong HF_ENDPOINT, offline mode, the hub failing): nothing is wrong
    with the request, and it may work later."""


def _endpoint(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return endpoint or constants.ENDPOINT


def unreachable(repo_id: str, endpoint: str | None, why: str) -> HubUnreachable:
    return HubUnreachable(f"cannot reach the Hugging Face hub at {_endpoint(endpoint)} to pull {repo_id} ({why}): "
                          "check the network connection, and HF_ENDPOINT if a mirror is meant; models already in the "
                          "cache are served without the hub (HF_HUB_OFFLINE=1 keeps huggingface_hub from trying it)")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' errors for a request that got no answer: huggingface_hub's (httpx2 in 2.x), httpx's."""
    found: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            found.append(__import__(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    etag: str  # the blob's name in the cache: the LFS sha256, else the git blob id (huggingface_hub's choice)
    sha256: str | None  # LFS files only
    blob_id: str | None


@dataclass(frozen=True)
class Plan:
    repo_id: str
    revision: str  # as asked ("main" when none)
    commit: str
    files: tuple[RemoteFile, ...]
    endpoint: str | None = None  # the hub's URL; None: huggingface_hub's (HF_ENDPOINT, else huggingface.co)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Progress:
    """One report: the file being fetched and the whole pull (bytes, rate in bytes/s, seconds left)."""

    repo_id: str
    file: str
    index: int  # 1-based, of `count`
    count: int
    file_done: int
    file_total: int
    done: int
    total: int
    rate: float
    eta_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"status": "downloading", **self.__dict__, "rate": round(self.rate), "eta_s":
                None if self.eta_s is None else round(self.eta_s, 1)}


def parse_ref(ref: str) -> tuple[str, str]:
    """`ORG/NAME[@REVISION]` -> (repo id, revision); BadReference naming ID_RULE for anything the hub would refuse."""
    repo_id, at, revision = ref.partition("@")
    bad_id = not REPO_ID.match(repo_id) or ".." in repo_id or "--" in repo_id
    bad_revision = at and (not REVISION.match(revision) or ".." in revision or len(revision) > MAX_REVISION)
    if bad_id or bad_revision:
        shown = ref if len(ref) <= 120 else ref[:100] + f"... ({len(ref)} characters)"
        raise BadReference(f"'{shown}' is not a model repository id: {ID_RULE}")
    return repo_id, revision or "main"


def wanted(name: str) -> bool:
    if name.startswith("voices/") and name.count("/") == 1:  # a Kokoro repo's voice packs
        return name.endswith(".safetensors")
    return ("/" not in name or name == "1_Pooling/config.json") and any(fnmatch(name, p) for p in WANTED)


def plan(ref: str, token: str | None = None, endpoint: str | None = None) -> Plan:
    """What pulling `ref` fetches, asked of the hub; PullError for a repo that is no MLX model."""
    from huggingface_hub import HfApi, errors

    repo_id, revision = parse_ref(ref)
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True, token=token)
    except errors.OfflineModeIsEnabled:
        raise HubUnreachable(f"cannot pull {repo_id}: offline mode is on (HF_HUB_OFFLINE); unset it to download "
                             "(models already in the cache are served as they are)") from None
    except errors.HFValidationError as exc:  # a rule of the hub's that ID_RULE missed: still the asker's to fix
        raise BadReference(f"'{ref}' is not a model repository id ({str(exc).splitlines()[0]}): {ID_RULE}") from None
    except errors.RevisionNotFoundError:
        raise PullError(f"{repo_id} has no revision '{revision}'") from None
    except errors.GatedRepoError:
        raise PullError(f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN to a token of yours") \
            from None
    except errors.RepositoryNotFoundError:
        raise PullError(f"no model repository '{repo_id}' on the hub (a private one needs HF_TOKEN set to a token "
                        "that may read it)") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status >= 500 or status in (408, 429):  # the hub's trouble, not the request's: it may work later
            raise unreachable(repo_id, endpoint, f"it answered HTTP {status}") from None
        raise PullError(f"the hub refused {repo_id}@{revision}: {str(exc).splitlines()[0]}") from None
    except _transport_errors() as exc:  # no answer at all: no network, a closed port, a name that resolves to nothing
        raise unreachable(repo_id, endpoint, _why(exc)) from None
    if not info.sha:
        raise PullError(f"the hub named no commit for {repo_id}@{revision}")
    files = tuple(sorted((RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else s.blob_id or "",
                                     s.lfs.sha256 if s.lfs else None, s.blob_id)
                          for s in info.siblings or [] if wanted(s.rfilename)), key=_order))
    names = {f.name for f in files}
    if not any(n.endswith(".safetensors") for n in names) or "config.json" not in names:
        gguf = any(s.rfilename.endswith(".gguf") for s in info.siblings or [])
        raise PullError(f"{repo_id} is not an MLX model: it has no {'config.json' if names else 'files'} and "
                        f"*.safetensors weights to load" + ("; for its GGUF file use `mlxsup import`" if gguf else ""))
    if any(not f.etag for f in files):
        raise PullError(f"the hub gave no blob ids for {repo_id}'s files: cannot verify them")
    if "modules.json" not in names and (why := unsupported(_remote_json(repo_id, info.sha, "config.json", token, endpoint))):
        raise PullError(f"{repo_id} cannot be served: {why}")
    return Plan(repo_id, revision, info.sha, files, endpoint)


def _order(f: RemoteFile) -> tuple[int, str]:
    """Small files first, the weights' index before the weights: a reader of the snapshot sees them in that order."""
    return (1 if f.name.endswith(".safetensors") else 0, f.name)


def _remote_json(repo_id: str, commit: str, name: str, token: str | None, endpoint: str | None) -> dict:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, http_backoff

    try:
        resp = http_backoff("GET", hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint),
                            headers=build_hf_headers(token=token))
    except _transport_errors() as exc:
        raise unreachable(repo_id, endpoint, _why(exc)) from None
    try:
        resp.raise_for_status()
        data = json.loads(resp.content)
    except Exception as exc:
        raise PullError(f"cannot read {repo_id}'s {name}: {exc}") from None
    return data if isinstance(data, dict) else {}


def disk_free(path: Path) -> int:
    """Free bytes on the file system that holds `path` (its nearest existing folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def still_needed(p: Plan, hub: Path) -> int:
    """The bytes a pull of `p` has yet to write: files not in the cache, less what their partial downloads hold."""
    blobs = store.repo_folder(hub, p.repo_id) / "blobs"
    need = 0
    for f in p.files:
        if not (blobs / f.etag).exists():
            part = blobs / f"{f.etag}.incomplete"
            need += f.size - (part.stat().st_size if part.exists() else 0)
    return max(need, 0)


class _Meter:
    """Counts the bytes a download writes and reports progress at most every PROGRESS_S."""

    def __init__(self, p: Plan, on_progress: Callable[[Progress], None]) -> None:
        self.plan, self.on_progress = p, on_progress
        self.done = 0  # bytes of the pull in the cache (resumed bytes count as done)
        self.fetched = 0  # bytes written by this run: the rate
        self.t0 = time.monotonic()
        self.last = 0.0
        self.file, self.index, self.file_done = "", 0, 0

    def start(self, f: RemoteFile, index: int, have: int) -> None:
        self.file, self.index, self.file_done = f.name, index, have
        self.done += have
        self.report(force=True)

    def add(self, n: int) -> None:
        self.file_done += n
        self.done += n
        self.fetched += n
        self.report()

    def restart_file(self) -> None:
        """The server ignored a resume: the file's bytes so far are gone."""
        self.done -= self.file_done
        self.file_done = 0

    def finish_file(self, f: RemoteFile) -> None:
        self.done += f.size - self.file_done
        self.file_done = f.size
        self.report(force=True)

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_S:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-6)
        rate = self.fetched / elapsed
        left = self.plan.total - self.done
        size = next(f.size for f in self.plan.files if f.name == self.file)
        self.on_progress(Progress(self.plan.repo_id, self.file, self.index, len(self.plan.files), self.file_done,
                                  size, self.done, self.plan.total, rate, left / rate if rate > 0 else None))


def _digest(path: Path, f: RemoteFile) -> tuple[str, str]:
    """(expected, actual) of the hash the hub gives for `f`: sha256 for LFS files, else git's blob sha1."""
    if f.sha256:
        h = hashlib.sha256()
        expected = f.sha256
    else:
        h = hashlib.sha1()
        h.update(f"blob {path.stat().st_size}\0".encode())
        expected = f.blob_id or ""
    with open(path, "rb") as src:
        while chunk := src.read(HASH_CHUNK):
            h.update(chunk)
    return expected, h.hexdigest()


def _fetch(p: Plan, f: RemoteFile, folder: Path, meter: _Meter, index: int, token: str | None) -> None:
    """Download `f` into its blob (resuming a partial download), verified before it is named a blob."""
    blob = folder / "blobs" / f.etag
    if blob.exists() and blob.stat().st_size == f.size:
        meter.start(f, index, f.size)
        return
    part = blob.with_name(f"{f.etag}.incomplete")
    part.parent.mkdir(parents=True, exist_ok=True)
    with open(part, "ab") as out:
        have = out.tell()
        if have > f.size:  # not this file's beginning: start over
            out.truncate(0)
            have = 0
        meter.start(f, index, have)
        _download(p, f, out, have, meter, token)
    size = part.stat().st_size
    expected, actual = _digest(part, f)
    if size != f.size or expected != actual:
        part.unlink()
        what = "sha256" if f.sha256 else "git blob id"
        raise PullError(f"{p.repo_id}: {f.name} does not match the hub's {what} (expected {expected}, got {actual}, "
                        f"{size} of {f.size} bytes): the download was removed and nothing of it is served")
    os.chmod(part, 0o644)
    os.replace(part, blob)
    meter.finish_file(f)


def _download(p: Plan, f: RemoteFile, out: BinaryIO, have: int, meter: _Meter, token: str | None) -> None:
    """Append `f`'s bytes from `have` on to `out`; a connection cut mid-file is resumed from where it stopped
    (a Range request), up to RETRIES times in a row without progress."""
    import httpx2
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    url = hf_hub_url(p.repo_id, f.name, revision=p.commit, endpoint=p.endpoint)
    tries = 0
    while have < f.size:
        headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            log.info("[pull] repo=%s file=%s phase=resume from=%d of=%d", p.repo_id, f.name, have, f.size)
        before = have
        try:
            with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     retry_on_exceptions=()) as resp:  # a cut is resumed here, not re-sent
                hf_raise_for_status(resp)
                if have and resp.status_code == 200:  # the server ignored the Range: it sends the whole file
                    out.seek(0)
                    out.truncate()
                    meter.restart_file()
                    have = 0
                for chunk in resp.iter_bytes():
                    out.write(chunk)
                    have += len(chunk)
                    meter.add(len(chunk))
            if have >= f.size:
                break
        except (httpx2.TransportError, httpx2.StreamError) as exc:
            log.warning("[pull] repo=%s file=%s phase=cut at=%d error=%s", p.repo_id, f.name, have, exc)
        finally:
            out.flush()
        tries = 0 if have > before else tries + 1
        if tries > RETRIES:
            raise PullError(f"{p.repo_id}: {f.name}: the hub stopped sending at byte {have} of {f.size}; "
                            "run the pull again to resume")
        time.sleep(min(2 ** tries, 8) if tries else 0.2)  # a retry's backoff


def _link(folder: Path, p: Plan, f: RemoteFile) -> None:
    pointer = folder / "snapshots" / p.commit / f.name
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not pointer.exists():
        pointer.unlink(missing_ok=True)  # a dangling link left by another tool
        os.symlink(os.path.relpath(folder / "blobs" / f.etag, pointer.parent), pointer)


def pull(p: Plan, hub: Path, on_progress: Callable[[Progress], None] = lambda _: None, token: str | None = None,
         free_bytes: Callable[[Path], int] = disk_free) -> Path:
    """Fetch `p` into the cache at `hub`; returns the snapshot folder. PullError when the space is short, a file
    does not verify, or the hub fails; an interruption (KeyboardInterrupt) leaves the mark saying so."""
    folder = store.repo_folder(hub, p.repo_id)
    mark = store.read_mark(folder)
    if mark is not None and mark.state == store.DOWNLOADING and mark.pid != os.getpid():
        raise PullError(f"{p.repo_id} is being pulled already (pid {mark.pid})")
    need, free = still_needed(p, hub), free_bytes(hub)
    if need > free:
        raise PullError(f"not enough disk space for {p.repo_id}: it needs {need} more bytes and {hub} has {free} free")
    for sub in ("blobs", "refs", "snapshots"):
        (folder / sub).mkdir(parents=True, exist_ok=True)  # a well-formed cache entry while it fills (scan_cache_dir)
    store.write_mark(folder, store.DOWNLOADING)
    log.info("[pull] repo=%s revision=%s commit=%s phase=start files=%d bytes=%d need=%d", p.repo_id, p.revision,
             p.commit, len(p.files), p.total, need)
    meter = _Meter(p, on_progress)
    try:
        for index, f in enumerate(p.files, 1):
            _fetch(p, f, folder, meter, index, token)
        for f in p.files:  # linked only once all verified: a snapshot never holds a model without its weights
            _link(folder, p, f)
        if p.revision != p.commit:
            (folder / "refs" / p.revision).parent.mkdir(parents=True, exist_ok=True)
            (folder / "refs" / p.revision).write_text(p.commit)
    except BaseException as exc:
        state = store.FAILED if isinstance(exc, PullError) else store.INTERRUPTED
        store.write_mark(folder, state, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        log.warning("[pull] repo=%s phase=%s error=%s", p.repo_id, state, exc)
        if isinstance(exc, PullError) or not isinstance(exc, Exception):  # Ctrl-C, a cancelled task: as they are
            raise
        raise PullError(f"{p.repo_id}: the download failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") \
            from exc
    store.clear_mark(folder)
    log.info("[pull] repo=%s commit=%s phase=done bytes=%d s=%.1f", p.repo_id, p.commit, p.total,
             time.monotonic() - meter.t0)
    return folder / "snapshots" / p.commit
