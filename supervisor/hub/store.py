"""The Hugging Face cache as mlxsup uses it: where a repo lives, the mark of a pull under way, what a model on
disk is (family, quantization, context), and removing a repo the hub's own way.

A pull marks its repo folder (`models--ORG--NAME/.mlxsup-pull.json`: the puller's pid and state) before it
writes anything and removes the mark only once every file is verified and linked. Invariants: a repo with a
mark is never offered for serving (registry.py skips it); the mark says "downloading" only while its
process lives, so a pull killed or interrupted reads as "interrupted", never as one that goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

MARK = ".mlxsup-pull.json"
DOWNLOADING, INTERRUPTED, FAILED = "downloading", "interrupted", "failed"


def repo_folder(hub: Path, repo_id: str) -> Path:
    return hub / f"models--{repo_id.replace('/', '--')}"


def repo_id_of(folder: Path) -> str:
    return folder.name[len("models--"):].replace("--", "/")


@dataclass(frozen=True)
class PullMark:
    repo_id: str
    state: str  # downloading | interrupted | failed
    pid: int
    error: str | None = None

    def message(self) -> str:
        if self.state == DOWNLOADING:
            return (f"the model '{self.repo_id}' is downloading (mlxsup pull, pid {self.pid}); it is served once "
                    "the download completes")
        why = f": {self.error}" if self.error else ""
        return (f"the download of '{self.repo_id}' did not complete ({self.state}{why}); "
                f"run `mlxsup pull {self.repo_id}` to resume it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it lives
        return True
    return True


def read_mark(folder: Path) -> PullMark | None:
    try:
        data = json.loads((folder / MARK).read_text())
        pid, state, error = int(data["pid"]), str(data["state"]), data.get("error")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return PullMark(repo_id_of(folder), INTERRUPTED, 0, "its pull mark is unreadable")
    if state == DOWNLOADING and not _alive(pid):
        state = INTERRUPTED
    return PullMark(repo_id_of(folder), state, pid, error if isinstance(error, str) else None)


def marks(hub: Path | None) -> dict[str, PullMark]:
    """Every marked repo of the cache, by repo id."""
    if hub is None or not hub.is_dir():
        return {}
    found = (read_mark(f.parent) for f in hub.glob(f"models--*/{MARK}"))
    return {m.repo_id: m for m in found if m is not None}


def write_mark(folder: Path, state: str, error: str | None = None) -> None:
    """Written whole (a temporary file renamed), so a reader never sees half a mark."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{MARK}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "state": state, "error": error}))
    os.replace(tmp, folder / MARK)


def clear_mark(folder: Path) -> None:
    (folder / MARK).unlink(missing_ok=True)


@dataclass(frozen=True)
class ModelFacts:
    """What `mlxsup ls` says of a model folder, from its config.json alone."""

    family: str | None
    quantization: str | None
    context_length: int | None


def facts(path: Path) -> ModelFacts:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return ModelFacts(None, None, None)
    if not isinstance(config, dict):
        return ModelFacts(None, None, None)
    merged = {**config, **(config.get("text_config") or {})}
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    dtype = merged.get("torch_dtype") or merged.get("dtype")
    context = merged.get("max_position_embeddings")
    try:  # an embedding model's window, as its worker serves it (worker/mlx_engine/pooling.py window_of)
        st = json.loads((path / "sentence_bert_config.json").read_text())
        seq = st.get("max_seq_length") if isinstance(st, dict) else None
        if isinstance(seq, int) and seq > 0 and isinstance(context, int):
            context = min(context, seq)
    except (OSError, ValueError):
        pass
    return ModelFacts(merged.get("model_type") if isinstance(merged.get("model_type"), str) else None,
                      f"{bits}-bit" if isinstance(bits, int) else (dtype if isinstance(dtype, str) else None),
                      context if isinstance(context, int) else None)


def disk_bytes(path: Path) -> int:
    """The bytes of a model folder's files (a snapshot's links followed to their blobs)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _files_reached(folder: Path) -> dict[tuple[int, int], tuple[int, int, set[str]]]:
    """(device, inode) -> (size, hard links, the paths known to name it) of every regular file in the folder and
    every one a link in it points to, wherever it is (links are not followed further than their target)."""
    found: dict[tuple[int, int], tuple[int, int, set[str]]] = {}
    for dirpath, _, filenames in os.walk(os.path.realpath(folder)):
        for name in filenames:
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path) if os.path.islink(path) else path
            try:
                st = os.stat(real, follow_symlinks=False)
            except OSError:  # a broken link
                continue
            if stat.S_ISREG(st.st_mode):
                found.setdefault((st.st_dev, st.st_ino), (st.st_size, st.st_nlink, set()))[2].add(real)
    return found


def remove(hub: Path, repo_id: str) -> int:
    """Delete a repo from the cache with huggingface_hub's own delete strategy (every revision, its refs and
    blobs), matched to this repo alone (a fork keeps its source's commit hashes, and the hub's delete_revisions
    matches a hash in any repo); what that leaves (a partial download's .incomplete files, a pull mark) goes with
    the folder. Returns the bytes really freed: the files gone with it whose every hard link went too; a snapshot
    link's target in another repo or outside the cache stays, and is not counted."""
    from huggingface_hub import scan_cache_dir

    folder = repo_folder(hub, repo_id)
    before = _files_reached(folder) if folder.exists() else {}
    info = scan_cache_dir(hub)
    repo = next((r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"), None)
    if repo is not None and repo.revisions:
        alone = dataclasses.replace(info, repos=frozenset({repo}))
        alone.delete_revisions(*(rev.commit_hash for rev in repo.revisions)).execute()
    if folder.exists():
        shutil.rmtree(folder)
    return sum(size for size, links, paths in before.values()
               if links <= len(paths) and not any(os.path.lexists(p) for p in paths))
