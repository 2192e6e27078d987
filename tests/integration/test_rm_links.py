"""`mlxsup rm` of a Hugging Face cache entry made of links (`snapshots/REV/FILE -> ../../blobs/HASH`) reports the
bytes it really freed, and removes nothing outside the entry.

A fake cache, no hub and no daemon: the entry's snapshot links to its own blobs (one blob linked twice), to a blob of
another repo, to a file outside the cache by an absolute path, and holds a blob hard-linked from outside. Only the
entry's own files whose every link goes with it are freed; what other repos and folders hold stays, with its bytes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from supervisor.hub import store
from tests.conftest import MLXSUP

REV = "0123456789abcdef0123456789abcdef01234567"
CONFIG = b'{"model_type": "llama", "max_position_embeddings": 256, "pad": "' + b"x" * 500 + b'"}'


def entry(hub: Path, repo_id: str, rev: str = REV, blobs: dict[str, bytes] | None = None,
          links: dict[str, str] | None = None) -> Path:
    """A cache repo folder: `blobs` by hash, snapshot `links` (file -> target, as written), refs/main -> rev."""
    folder = store.repo_folder(hub, repo_id)
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(rev)
    snap = folder / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, data in (blobs or {}).items():
        (folder / "blobs" / name).write_bytes(data)
    for name, target in (links or {}).items():
        (snap / name).symlink_to(target)
    return folder


def regular_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def snapshot(root: Path) -> dict[str, object]:
    return {str(p.relative_to(root)): (("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file()
                                       else "dir") for p in root.rglob("*")}


def test_rm_of_linked_snapshot_files_counts_only_what_it_removed(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    other = entry(hub, "org/Other", rev="f" * 40, blobs={"big": b"o" * 50_000, "cfg": CONFIG},
                  links={"model.safetensors": "../../blobs/big", "config.json": "../../blobs/cfg"})
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"e" * 40_000)
    (outside / "hard.bin").write_bytes(b"h" * 30_000)
    target = entry(hub, "org/Target", blobs={"cfg": CONFIG, "w": b"w" * 100},
                   links={"config.json": "../../blobs/cfg", "config-copy.json": "../../blobs/cfg",
                          "model.safetensors": "../../blobs/w",
                          "shared.safetensors": f"../../../{other.name}/blobs/big",
                          "outside.safetensors": str(outside / "weights.bin")})
    os.link(outside / "hard.bin", target / "blobs" / "hard")
    (target / "snapshots" / REV / "hard.bin").symlink_to("../../blobs/hard")
    freed = regular_bytes(target) - 30_000  # its own files, less the blob another link keeps
    kept = {"other": snapshot(other), "outside": snapshot(outside)}

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXSUP_", "HF_"))}
    env |= {"HF_HUB_CACHE": str(hub), "XDG_CONFIG_HOME": str(tmp_path / "no-config"),
            "XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([*MLXSUP, "rm", "org/Target", "--url", "http://127.0.0.1:9"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"removed org/Target from {hub}: {freed} B freed", run.stdout
    assert not target.exists()
    assert {"other": snapshot(other), "outside": snapshot(outside)} == kept


def test_store_remove_returns_the_bytes_it_freed(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    other = entry(hub, "org/Other", rev="f" * 40, blobs={"big": b"o" * 5_000})
    target = entry(hub, "org/Target", blobs={"cfg": CONFIG, "w": b"w" * 100},
                   links={"config.json": "../../blobs/cfg", "model.safetensors": "../../blobs/w",
                          "also.json": "../../blobs/cfg", "shared.bin": f"../../../{other.name}/blobs/big"})
    (target / "blobs" / "unlinked.incomplete").write_bytes(b"i" * 300)  # a partial download: removed, so freed
    freed = regular_bytes(target)
    assert store.remove(hub, "org/Target") == freed
    assert not target.exists() and (other / "blobs" / "big").read_bytes() == b"o" * 5_000


def test_rm_removes_only_its_own_repo_when_forks_share_its_commit_hash(tmp_path: Path) -> None:
    """A fork or a duplicate repo keeps the commit hashes of its source; huggingface_hub's delete_revisions matches
    hashes across the whole cache and deleted whichever of those repos it met first."""
    hub = tmp_path / "hub"
    forks = [entry(hub, f"fork{i}/Model", blobs={"cfg": CONFIG, "w": bytes([i]) * 1000},
                   links={"config.json": "../../blobs/cfg", "model.safetensors": "../../blobs/w"}) for i in range(8)]
    target = entry(hub, "org/Model", blobs={"cfg": CONFIG, "w": b"t" * 1000},
                   links={"config.json": "../../blobs/cfg", "model.safetensors": "../../blobs/w"})
    kept = {f.name: snapshot(f) for f in forks}
    freed = regular_bytes(target)
    assert store.remove(hub, "org/Model") == freed
    assert not target.exists()
    assert {f.name: snapshot(f) for f in forks if f.exists()} == kept
