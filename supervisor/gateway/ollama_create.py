"""Ollama's `/api/create` where it maps onto `mlxsup import`: a model made from one GGUF file, and the
blobs its clients upload first (`HEAD`/`POST /api/blobs/sha256:<hex>`).

A client (`ollama create -f Modelfile`, the Python and JavaScript clients' `create(files=...)`) uploads the file as a
blob, its name its sha256, then asks `{"model": NAME, "files": {"x.gguf": "sha256:<hex>"}}`. The blob is kept in
`state_dir/ollama-blobs` (its bytes checked against its name as they arrive; a mismatch is a 400 and nothing is
kept), and the create runs the import (`python -m worker.mlx_engine.gguf_import BLOB state_dir/models/NAME`, as
`mlxsup import` does; `quantize` "q4_*" or "q8_*" is its --quantize) with Ollama's streamed status objects. `from`
naming a model that is there, with nothing else, gives it the new name (as /api/copy does). What a Modelfile adds
that an MLX folder has no place for (a Go `template`, `system`, `parameters`, `adapters`, `messages`), several
files or safetensors, is a 400 that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.ollama_api import bad
from supervisor.gateway.ollama_models import LATEST
from supervisor.gateway.ollama_shape import dumps

log = logging.getLogger(__name__)
DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # mlxsup import's model names (cli/importer.py NAME_RULE)
UNSUPPORTED = ("template", "system", "parameters", "adapters", "messages", "license")


class Blobs:
    def __init__(self, settings: Settings) -> None:
        self.root = settings.state_dir / "ollama-blobs"

    def path(self, digest: str) -> Path:
        match = DIGEST.fullmatch(digest)
        if match is None:
            raise bad(f"'{digest[:80]}' is no blob digest: sha256:<64 hex digits>", "digest")
        return self.root / f"sha256-{match.group(1)}"

    async def head(self, request: Request) -> Response:
        return Response(status_code=200 if self.path(request.path_params["digest"]).is_file() else 404)

    async def upload(self, request: Request) -> Response:
        """The body streamed to a file beside the blob's place, hashed as it comes; renamed into place if it is what
        its name says (201), else removed (400). A blob there already is kept, the body read and dropped."""
        target = self.path(request.path_params["digest"])
        self.root.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}-{id(request)}")
        digest = hashlib.sha256()
        try:
            out = await asyncio.to_thread(open, partial, "wb")
            with out:
                async for chunk in request.stream():
                    digest.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
            if f"sha256-{digest.hexdigest()}" != target.name:
                raise bad(f"the uploaded bytes' digest is sha256:{digest.hexdigest()}, not the "
                          f"{target.name.replace('-', ':', 1)} they were sent as", "digest")
            os.replace(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return Response(status_code=201)


def _quantize(value: Any) -> list[str]:
    if value in (None, ""):
        return []
    if isinstance(value, str) and value.lower().startswith(("q4", "q8")):
        return ["--quantize", value[1]]
    raise bad("quantize: mlxsup's import quantizes to 4 or 8 bits: \"q4_K_M\", \"q4_0\", \"q8_0\" (or leave it out)",
              "quantize")


def gguf_of(body: dict, blobs: Blobs) -> Path:
    files = body.get("files")
    if not isinstance(files, dict) or len(files) != 1:
        raise bad("files: mlxsup creates a model from one GGUF file ({\"NAME.gguf\": \"sha256:...\"}); a folder of "
                  "safetensors is served by putting it in a model folder", "files")
    (name, digest), = files.items()
    if not isinstance(name, str) or not name.lower().endswith(".gguf") or not isinstance(digest, str):
        raise bad("files: mlxsup creates a model from one GGUF file (a .gguf, named by its blob's digest)", "files")
    path = blobs.path(digest)
    if not path.is_file():
        raise bad(f"blob {digest[:80]} is not here: upload it first (POST /api/blobs/{digest[:80]})", "files")
    return path


async def import_lines(gguf: Path, out: Path, extra: list[str]) -> AsyncIterator[dict]:
    """The import run as `mlxsup import` runs it, said as Ollama's create statuses; its error as an error object."""
    yield {"status": "parsing GGUF"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf),
                                                str(out), *extra, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    said: list[str] = []
    try:
        assert proc.stdout is not None
        yield {"status": "converting to an MLX model folder"}
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                said.append(line)
                log.info("[ollama] create %s: %s", out.name, line)
        code = await proc.wait()
    finally:
        if proc.returncode is None:  # the client left: the import goes too (its dot-folder is never renamed in)
            proc.kill()
            await proc.wait()
    if code != 0:
        yield {"error": f"the import of the GGUF file failed: {said[-1] if said else f'exit {code}'}"}
        return
    for status in ("writing manifest", "success"):
        yield {"status": status}


async def create(body: dict, settings: Settings, blobs: Blobs, copy: Callable[[str, str], None],
                 refresh: Callable[[], None]) -> Response | AsyncIterator[bytes]:
    """The whole answer, or the lines of a streamed one. `copy(source, name)` names an existing model anew (as
    /api/copy does); `refresh()` makes the registry look at its folders now."""
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not NAME.fullmatch(name.removesuffix(f":{LATEST}")):
        raise bad("model must be a model name: 1 to 128 letters, digits, '_', '.' and '-' (and :latest)", "model")
    name = name.removesuffix(f":{LATEST}")
    if given := [k for k in UNSUPPORTED if body.get(k) not in (None, "", [], {})]:
        raise bad(f"{', '.join(given)}: a Modelfile's {given[0]} has no place in an MLX model folder (mlxsup reads the "
                  "model's own chat template and generation_config.json)", given[0])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    if body.get("files") is None and isinstance(body.get("from"), str):
        copy(body["from"], name)
        return JSONResponse({"status": "success"})
    gguf = gguf_of(body, blobs)
    extra = _quantize(body.get("quantize"))
    out = settings.import_dir / name
    if out.exists():
        raise bad(f"model '{name}' exists already ({out}): delete it first", "model")
    settings.import_dir.mkdir(parents=True, exist_ok=True)

    async def lines() -> AsyncIterator[bytes]:
        async for line in import_lines(gguf, out, extra):
            if line.get("status") == "writing manifest":
                refresh()
            yield dumps(line)

    if stream is False:
        last: dict = {}
        async for line in import_lines(gguf, out, extra):
            last = line
        if "error" in last:
            raise errors.InvalidRequest(last["error"])
        refresh()
        return JSONResponse(last)
    return lines()
