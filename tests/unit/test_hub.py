"""Pure pieces of pulling and naming: repo references, which files a pull keeps, pull marks, short names,
and a weights index whose shards are not all there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.errors import ModelDownloading, ModelNotFound
from supervisor.hub import store
from supervisor.hub.arch import unsupported
from supervisor.hub.pull import BadReference, HubUnreachable, PullError, parse_ref, plan, wanted
from supervisor.registry import Registry, is_model_dir


def model(path: Path, shards: tuple[str, ...] = ("model.safetensors",), index: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for s in shards:
        (path / s).write_bytes(b"\0")
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return path


def test_repo_references() -> None:
    assert parse_ref("mlx-community/Qwen3-4B-4bit") == ("mlx-community/Qwen3-4B-4bit", "main")
    assert parse_ref("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_ref("org/name@refs/pr/1") == ("org/name", "refs/pr/1")  # the hub's name for a PR's head
    assert parse_ref(f"org/name@{'a' * 40}") == ("org/name", "a" * 40)
    for bad in ("name", "org/name@", "../x/y", "org/na/me", "org/..", "https://hf.co/org/name"):
        with pytest.raises(PullError):
            parse_ref(bad)


@pytest.mark.parametrize("ref", [
    "org--x/name", "org/name--x", "org/.git", "org/name.", "-org/name", "org/name-", "org/x..y", "o" * 97 + "/n",
    "org/" + "n" * 97, "org/name@" + "a" * 256, "org/name@refs//pr", "org/name@/main", "org/name@main/",
    "org/name@a..b", "org/name@.hidden", "org/name@x.lock", "org/name@a b", "org/name@a~1", "org/name@a:b",
    "org/name@a@b", "org/na me",
])
def test_ids_the_hub_refuses_are_refused_here_naming_the_rule(ref: str) -> None:
    """They passed the old pattern and failed in huggingface_hub's validation or at the hub: a 500 and a
    traceback. Now a BadReference (a 400, and exit 2 on the command line) whose message says the rule."""
    with pytest.raises(BadReference) as err:
        parse_ref(ref)
    assert isinstance(err.value, PullError) and "ORG/NAME[@REVISION]" in str(err.value)
    assert "96 characters" in str(err.value) and "--" in str(err.value)


def test_an_unreachable_hub_is_hub_unreachable_saying_what_to_do() -> None:
    """A hub on a closed local port: httpx's ConnectError escaped plan() (a 500, a traceback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with ends: nothing listens there
    with pytest.raises(HubUnreachable) as err:
        plan("org/name", endpoint=f"http://127.0.0.1:{port}")
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "network" in message and "HF_ENDPOINT" in message
    assert "HF_HUB_OFFLINE" in message and "\n" not in message


def test_only_what_a_worker_reads_is_pulled() -> None:
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json", "tokenizer.model",
                 "chat_template.jinja", "preprocessor_config.json", "merges.txt", "1_Pooling/config.json"):
        assert wanted(name), name
    for name in ("README.md", "pytorch_model.bin", "model.gguf", "original/consolidated.safetensors", "img.png"):
        assert not wanted(name), name


def test_an_architecture_mlx_lm_lacks_is_named() -> None:
    assert unsupported({"model_type": "llama"}) is None
    assert "model_type 'alien'" in (unsupported({"model_type": "alien"}) or "")
    assert unsupported({"model_type": "bert", "architectures": ["BertModel"]}) is None  # the worker's own encoder


def test_a_half_copied_model_of_several_shards_is_no_model(tmp_path: Path) -> None:
    half = model(tmp_path / "half", ("model-00001-of-00002.safetensors",), index=True)
    assert not is_model_dir(half)
    (half / "model-00002-of-00002.safetensors").write_bytes(b"\0")
    assert is_model_dir(half)


def test_short_names_resolve_where_unambiguous(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    for repo in ("org-a/Shared", "org-b/Shared", "org-a/Only"):
        folder = store.repo_folder(hub, repo)
        model(folder / "snapshots" / ("0" * 40))
    reg = Registry.build([], [], hub)
    assert reg.resolve("Only").id == "org-a/Only"
    assert reg.resolve("org-b/Shared").id == "org-b/Shared"
    with pytest.raises(ModelNotFound, match="ambiguous: say which of org-a/Shared, org-b/Shared"):
        reg.resolve("Shared")


def test_a_marked_repo_is_not_served_downloading_while_its_puller_lives(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    folder = store.repo_folder(hub, "org/Pulling")
    model(folder / "snapshots" / ("0" * 40))
    store.write_mark(folder, store.DOWNLOADING)  # this process: alive
    reg = Registry.build([], [], hub)
    assert "org/Pulling" not in reg.ids()
    with pytest.raises(ModelDownloading, match="is downloading"):
        reg.resolve("Pulling")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / store.MARK).write_text(json.dumps({"pid": int(gone.stdout), "state": "downloading"}))
    assert store.read_mark(folder) == store.PullMark("org/Pulling", store.INTERRUPTED, int(gone.stdout))
    with pytest.raises(ModelNotFound, match="did not complete .* run `mlxsup pull org/Pulling`"):
        reg.resolve("org/Pulling")
    store.clear_mark(folder)
    assert reg.resolve("org/Pulling").id == "org/Pulling"  # complete: served from the next request


def test_an_embedding_models_context_is_its_served_window(tmp_path: Path) -> None:
    """`mlxsup ls` said 512 for MiniLM where `status` (the worker's window) said 256: sentence-transformers' max."""
    from supervisor.hub.store import facts

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 512}))
    assert facts(tmp_path).context_length == 512
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    assert facts(tmp_path).context_length == 256
