"""A stand-in for the Hugging Face hub on loopback: the two endpoints huggingface_hub calls to pull a model.

- `GET /api/models/{org}/{name}/revision/{rev}?blobs=true`: the model info (commit sha, each file's size, git
  blob id, and LFS sha256 for *.safetensors), or 404 with `X-Error-Code: RepoNotFound` /
  `RevisionNotFound` as the hub answers.
- `GET|HEAD /{org}/{name}/resolve/{rev}/{file}`: the bytes, with ETag, X-Repo-Commit, Content-Length, and
  X-Linked-Size / X-Linked-Etag for LFS files; a `Range: bytes=N-` request is answered 206 from N.
Faults, per (repo id, file name): `cut[key] = N` sends N bytes of the next GET, then holds the connection until
`release` is set and drops it (a download cut mid-file); `corrupt[key] = True` serves other bytes than
the info's hashes describe. Every request is recorded (`requests`: method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> file name -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha

    def add(self, files: dict[str, bytes], branch: str = "main") -> str:
        sha = hashlib.sha1(repr(sorted((n, hashlib.sha256(b).hexdigest()) for n, b in files.items())).encode()
                           ).hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        return sha

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


def folder_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


class StandInHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.cut: dict[tuple[str, str], int] = {}
        self.corrupt: dict[tuple[str, str], bool] = {}
        self.release = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="standin-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StandInHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def info(self, repo_id: str, rev: str) -> tuple[int, dict, dict]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"X-Error-Code": "RepoNotFound"}, {"error": "Repository not found"}
        sha = repo.commit(rev)
        if sha is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, {"error": "Invalid rev id"}
        siblings = []
        for name, data in repo.commits[sha].items():
            s: dict = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name.endswith(".safetensors"):
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(s)
        return 200, {}, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "siblings": siblings}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and "revision" in parts:
                    at = parts.index("revision")
                    status, headers, body = hub.info("/".join(parts[2:at]), "/".join(parts[at + 1:]))
                    return self._send(status, headers, json.dumps(body).encode(), head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
                return self._send(404, {}, b'{"error": "not found"}', head)

            def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
                repo = hub.repos.get(repo_id)
                sha = repo.commit(rev) if repo else None
                if repo is None or sha is None or name not in repo.commits[sha]:
                    return self._send(404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "not found"}', head)
                data = repo.commits[sha][name]
                etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_blob_id(data)
                headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha}
                if name.endswith(".safetensors"):
                    headers |= {"X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{etag}"'}
                if hub.corrupt.get((repo_id, name)):
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                start = 0
                if (rng := self.headers.get("Range")) and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                cut = hub.cut.pop((repo_id, name), None) if not head else None
                if cut is None:
                    return self._send(206 if start else 200, headers, body, head)
                self.send_response(206 if start else 200)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body[:cut])
                self.wfile.flush()
                hub.release.wait(120)  # held mid-file until the test lets go, then dropped
                self.close_connection = True

            def _send(self, status: int, headers: dict, body: bytes, head: bool) -> None:
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body)), "Content-Type":
                             "application/json" if body.startswith(b"{") else "application/octet-stream"}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        return Handler
