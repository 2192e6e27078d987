"""The real coding agents (Claude Code, Continue's CLI, Codex CLI, opencode: npm; aider: PyPI), pinned and installed
once into a cache outside the repo; and one daemon whose tiny qwen3 answers from a script.

`agent_bin`: the folder of the npm programs' executables (package.json / package-lock.json here),
`~/.cache/mlxsup-test-agents/<lock hash>/node_modules/.bin`, reused while the lock is unchanged. npm installs into a
fresh folder that is renamed into place only once every program answers `--version`, so a broken install is never
reused. Tests needing the programs are skipped, saying why, only when npm itself is missing or cannot reach its
registry; any other failure fails. (`npm install` with the lock, not `npm ci`: a registry mirror that lacks other
platforms' optional packages leaves them out of the lock, and `npm ci` then refuses the lock as out of date; the
lock's versions and hashes still hold.) To move a pin: change package.json, then in a scratch folder holding only
it, `npm install --package-lock-only --no-audit --no-fund`, and copy its package-lock.json here.

`aider_bin`: aider (`aider-chat==AIDER`, whose own dependencies are pinned exactly by its release) in a venv of its
own, `~/.cache/mlxsup-test-agents/aider-<version>-py<X.Y>/bin`. A venv cannot be moved (its scripts name their
interpreter by absolute path), so it is built in a folder of its own that is never moved, and the name above is a
symlink switched onto it only once `aider --version` answers. Skipped, saying why, only when pip cannot reach its
registry.

`scripted_daemon`: a daemon with an API key and otherwise the default configuration (no `model_aliases`, no
`default_model`: the vendors' model names go to the one chat model there is), whose qwen3 worker runs with
`--script` (worker/mlx_engine/scripted.py): SCRIPT's replies are forced token by token through the real model,
tokenizer, template, output parser and streams, so an agent's tool loop runs the same way every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon

HERE = Path(__file__).parent
PROGRAMS = ("claude", "cn", "codex", "opencode")
AIDER = "0.86.2"  # aider-chat on PyPI
KEY = "sk-local-test"
UNREACHABLE = re.compile(r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|EHOSTUNREACH")
PIP_UNREACHABLE = re.compile(r"NewConnectionError|ConnectTimeoutError|Temporary failure in name resolution|"
                             r"Name or service not known|Network is unreachable|Connection refused|ProxyError")
DONE = "MLXSUP-DONE"  # in every final answer
# a project's agent with one tool, so that its requests stay small (the built-in ones get every tool: ~23k tokens)
CHECKER = "---\nname: checker\ndescription: Checks a file\ntools: Read\n---\nCheck what you are asked to, and report.\n"
MADE = "echo made > made.txt && echo MLXSUP-STEP-2"  # the command each program's shell tool is asked to run
GREETING = "first line\nhello\nlast line\n"  # the file aider is asked to edit; AIDER_EDIT changes its middle line
AIDER_EDIT = "hello from aider"


def tool_call(name: str, arguments: dict) -> str:
    """A qwen3 tool call, as the model writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# The first request of each program's loop is told apart by its step-1 marker in the prompt; every program's
# tool result then holds MLXSUP-STEP-2 (what the command prints), which the final answer follows.
SCRIPT = [
    {"match": "MLXSUP-STEP-2", "reply": f"The file is made. {DONE}"},
    {"match": "CLAUDE-STEP-1", "reply": tool_call("Bash", {"command": MADE, "description": "Create made.txt"})},
    # a Claude Code subagent (CHECKER) on its small model: its report carries MLXSUP-STEP-2 back to the main loop
    {"match": "CLAUDE-HELPER-1", "reply": tool_call("Agent", {
        "description": "Check made.txt", "prompt": "Check made.txt. CLAUDE-SUB-1", "subagent_type": "checker",
        "model": "haiku", "run_in_background": False})},
    {"match": "CLAUDE-SUB-1", "reply": "made.txt holds made. MLXSUP-STEP-2"},
    {"match": "CODEX-STEP-1", "reply": tool_call("exec_command", {"cmd": MADE})},
    {"match": "OPENCODE-STEP-1", "reply": tool_call("bash", {"command": MADE, "description": "Create made.txt"})},
    {"match": "CONTINUE-STEP-1", "reply": tool_call("Bash", {"command": MADE})},
    # aider edits through its edit format, not tools: a SEARCH/REPLACE block (its "diff" format) naming the file
    {"match": "AIDER-EDIT-1", "reply": f"greeting.txt\n```\n<<<<<<< SEARCH\nhello\n=======\n{AIDER_EDIT}\n"
                                       f">>>>>>> REPLACE\n```\nThe greeting is changed. {DONE}"},
    {"match": "WEATHER-STEP-1", "reply": tool_call("get_weather", {"city": "Paris", "days": 2})},
]


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    lock = (HERE / "package-lock.json").read_bytes()
    cache = _cache()
    target = cache / hashlib.sha256(lock + (HERE / "package.json").read_bytes()).hexdigest()[:16]
    bin_dir = target / "node_modules" / ".bin"
    if all((bin_dir / p).exists() for p in PROGRAMS):
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the coding agents cannot be installed")
    partial = cache / f"{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copy(HERE / name, partial / name)
    done = subprocess.run([npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(partial)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        out = done.stdout + done.stderr
        if unreachable := UNREACHABLE.search(out):
            pytest.skip(f"npm cannot reach its registry ({unreachable.group(0)})")
        raise AssertionError(f"npm install failed ({done.returncode}):\n{out[-3000:]}")
    for p in PROGRAMS:
        version = subprocess.run([str(partial / "node_modules" / ".bin" / p), "--version"], capture_output=True,
                                 text=True, timeout=60)
        assert version.returncode == 0, f"{p} --version: {version.stdout}{version.stderr}"
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return bin_dir


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxsup-test-agents"


@pytest.fixture(scope="session")
def aider_bin() -> Path:
    cache = _cache()
    link = cache / f"aider-{AIDER}-py{sys.version_info.major}.{sys.version_info.minor}"
    if (link / "bin" / "aider").exists():
        return link / "bin"
    built = cache / f"{link.name}.build-{os.getpid()}"  # where the venv stays: its scripts name this path
    shutil.rmtree(built, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(built)], check=True, capture_output=True, timeout=300)
    done = subprocess.run([str(built / "bin" / "python"), "-m", "pip", "install", "--no-input",
                           "--disable-pip-version-check", f"aider-chat=={AIDER}"],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(built, ignore_errors=True)
        out = done.stdout + done.stderr
        if unreachable := PIP_UNREACHABLE.search(out):
            pytest.skip(f"pip cannot reach its registry ({unreachable.group(0)})")
        raise AssertionError(f"pip install aider-chat=={AIDER} failed ({done.returncode}):\n{out[-3000:]}")
    version = subprocess.run([str(built / "bin" / "aider"), "--version"], capture_output=True, text=True, timeout=120)
    if version.returncode != 0 or AIDER not in version.stdout:
        shutil.rmtree(built, ignore_errors=True)
        raise AssertionError(f"aider --version ({version.returncode}): {version.stdout}{version.stderr}")
    old = link.resolve() if link.is_symlink() else None
    staged = cache / f"{link.name}.link-{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(built.name)
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(staged, link)  # atomic: another run sees the old install or this whole one
    if old is not None and old != built and old.parent == cache:
        shutil.rmtree(old, ignore_errors=True)
    return link / "bin"


def start_scripted(root: Path, server: str = "", worker_args: tuple[str, ...] = (),
                   env: dict | None = None) -> Daemon:
    """A daemon in `root` whose tiny qwen3 answers from SCRIPT; `server`: more [server] lines, `worker_args` more
    arguments for its worker (a fault), `env` the daemon's environment."""
    model = root / "qwen3"
    subprocess.run([*MLXSUP, "make-model", str(model), "--arch", "qwen3", "--preset", "tiny"], check=True,
                   capture_output=True)
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = root / "mlxsup.toml"
    args = ", ".join(json.dumps(a) for a in ("--script", str(script), *worker_args))
    config.write_text(f'[server]\napi_key = "{KEY}"\n{server}'
                      f'[models.qwen3]\npath = "{model}"\nworker_args = [{args}]\n')
    return start_daemon(root / "state", "--config", str(config), env=env)


@pytest.fixture(scope="session")
def scripted_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_scripted(tmp_path_factory.mktemp("scripted"))
    yield d
    assert d.stop() == 0

