"""Claude Code, Codex CLI, opencode, Continue's CLI and aider, the real programs, each completing its loop against
the daemon.

Each program runs non-interactively with an isolated HOME, against the scripted qwen3 (tests/agents/conftest.py)
through a recording proxy: the model calls the program's shell tool to create made.txt in the program's work dir,
the program runs it and sends the result back, the model's final answer is printed. aider has no tools: it edits
the files it was given through its edit format, so its model answers with a SEARCH/REPLACE block that aider applies
to greeting.txt. Every program's HTTP(S)_PROXY refuses the outside world and records what was tried. Each run is
bounded by its progress, not by a wall clock a loaded machine misses: it goes on while its requests do (a request
served, a response's bytes arriving: a stream's tokens or keep-alives), and is killed after QUIET_S with none, or
at CAP_S in all; the program's whole process session is proven gone afterwards.

Each program runs as a new user would, with its default settings (issue 26): Claude Code's max_tokens and
opencode's pass the context and are clamped to it, Codex's client_metadata is ignored. Claude Code gets nothing but
ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY (issue 34): its nonessential traffic (api.anthropic.com) is refused
outside, and its two turns, the second with a subagent on its small model (claude-haiku-*), run on the one worker
of the daemon's default configuration. The daemon's log must show
every request of the run served 200, and the model nothing left running. docs/agents-traffic.md records what each
sends; the README's "Using mlxsup with coding agents" gives these very settings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.agents.conftest import AIDER_EDIT, CHECKER, DONE, GREETING, KEY
from tests.agents.proxy import OutsideRefused, RecordingProxy, Seen
from tests.conftest import Daemon, assert_gone, wait_for

REQUEST_LINE = re.compile(r"\[request\] model=(\S+) endpoint=(\S+) status=(\d+)")
CLAUDE_ARGS = ["--output-format", "json", "--allowedTools", "Bash"]
LOADED = re.compile(r"\[load\] model=(\S+) pid=\d+ ready")  # once per worker started, spare or not
QUIET_S = 240.0  # a run with no progress for this long is stuck (its start before the first request included)
CAP_S = 1800.0  # and no run, progressing or not, goes on past this
POLL_S = 2.0


@dataclass
class Ran:
    rc: int | None  # None: killed (`why`)
    out: str
    err: str
    why: str = ""  # why it was killed: no progress for so long, or the cap

    def said(self) -> str:
        """What to show when it failed: why it was killed, if it was, and the end of what it wrote."""
        return f"{self.why}\n{self.out[-3000:]}\n{self.err[-3000:]}".strip()


@dataclass
class Setup:
    home: Path
    work: Path
    bin_dir: Path
    daemon: Daemon
    log_from: int  # the daemon log's size when this test began


def _setup(tmp_path: Path, bin_dir: Path, daemon: Daemon) -> Iterator[Setup]:
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    s = Setup(tmp_path / "home", tmp_path / "work", bin_dir, daemon, (daemon.state_dir / "daemon.log").stat().st_size)
    yield s
    served_all(s)


@pytest.fixture
def setup(tmp_path: Path, agent_bin: Path, scripted_daemon: Daemon) -> Iterator[Setup]:
    """For the npm programs."""
    yield from _setup(tmp_path, agent_bin, scripted_daemon)


@pytest.fixture
def aider_setup(tmp_path: Path, aider_bin: Path, scripted_daemon: Daemon) -> Iterator[Setup]:
    yield from _setup(tmp_path, aider_bin, scripted_daemon)


def daemon_log(s: Setup, start: int | None = None) -> str:
    """The daemon's log since this test began (from `start`, when given)."""
    with open(s.daemon.state_dir / "daemon.log", "rb") as f:
        f.seek(s.log_from if start is None else start)
        return f.read().decode(errors="replace")


def models_now(s: Setup) -> list[dict]:
    """/api/status's models (the daemon wants its key there too)."""
    status = httpx.get(s.daemon.url + "/api/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    return status.json()["models"]


def usage_of(seen: Seen) -> dict:
    """The usage a Messages response reported: the whole message's, or the last a stream's events gave."""
    text = seen.response.decode(errors="replace")
    if text.lstrip().startswith("{"):
        return json.loads(text).get("usage") or {}
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return next((e["usage"] for e in reversed(events) if "usage" in e), {})


def served_all(s: Setup) -> None:
    """The daemon served every request of the run 200 (a refusal would be logged with its 4xx), and nothing of it
    is left running on the model."""
    log = daemon_log(s)
    served = REQUEST_LINE.findall(log)
    assert served and all(status == "200" for _, _, status in served), served
    assert "context_length_exceeded" not in log and "unknown field" not in log

    def idle() -> bool:
        return all(m["in_flight"] == 0 and m["queued"] == 0 for m in models_now(s))

    wait_for(idle, 30, what="the model to have nothing in flight")


def progress(s: Setup, proxy: RecordingProxy | None) -> tuple[int, ...]:
    """How far the run's requests have got: those the daemon served 200 (its log), and those the proxy saw answered
    200 with their response bytes so far (a stream's tokens, its keep-alives while it waits). A refused request is
    no progress: a program that retries one forever (opencode compacts its history and sends it again) stops."""
    served = [status for _, _, status in REQUEST_LINE.findall(daemon_log(s))].count("200")
    if proxy is None:
        return (served,)
    answered = [seen for seen in list(proxy.seen) if seen.status == 200]
    return served, len(answered), sum(len(seen.response) for seen in answered)


def run(argv: list[str], s: Setup, env: dict[str, str], outside: OutsideRefused, proxy: RecordingProxy | None = None,
        timeout: float = CAP_S, quiet_s: float = QUIET_S) -> Ran:
    """The program in a session of its own, with nothing but loopback reachable; killed after `quiet_s` without
    progress (`progress`: with `proxy`, the one it talks to the daemon through, its responses' bytes count too;
    without one, only `timeout` bounds it, as before) or at `timeout` in all; every process of its session gone
    before this returns."""
    base = {"PATH": f"{s.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(s.home), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            **{name: outside.url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")}}
    proc = subprocess.Popen(argv, cwd=s.work, env={**base, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    rc: int | None = None
    why = ""
    began = moved = time.monotonic()
    last = progress(s, proxy)
    while True:
        try:
            out, err = proc.communicate(timeout=POLL_S)  # a retry after a timeout loses none of the output
            rc = proc.returncode
            break
        except subprocess.TimeoutExpired:
            now, got = time.monotonic(), progress(s, proxy)
            if got != last:
                last, moved = got, now
            if proxy is not None and now - moved > quiet_s:
                why = f"killed: no progress for {now - moved:.0f}s ({now - began:.0f}s in; {last})"
            elif now - began > timeout:
                why = f"killed: still running after {now - began:.0f}s, the cap ({last})"
            if why:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                break
    left = [p.pid for p in psutil.process_iter() if _session(p.pid) == proc.pid]
    for pid in left:  # whatever it left running in its session (a shell, a server)
        os.kill(pid, signal.SIGKILL)
    assert_gone([proc.pid, *left])
    return Ran(rc, out, err, why)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def made(s: Setup) -> bool:
    return (s.work / "made.txt").is_file() and (s.work / "made.txt").read_text() == "made\n"


def test_claude_code_with_its_defaults_runs_two_turns_on_one_worker(setup: Setup) -> None:
    """Only where the API is and a key (nonessential traffic on, no model variables): a Bash turn, then a
    `--continue` turn whose helper subagent runs on Claude Code's small model; every name is served by the one
    worker, and the second turn reads the first's prompt from the cache."""
    (setup.work / ".claude" / "agents").mkdir(parents=True)
    (setup.work / ".claude" / "agents" / "checker.md").write_text(CHECKER)
    with RecordingProxy(setup.daemon.url) as proxy, OutsideRefused() as outside:
        env = {"ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_API_KEY": KEY}
        first = run(["claude", "-p", "Create the file made.txt. CLAUDE-STEP-1", *CLAUDE_ARGS], setup, env, outside,
                    proxy)
        turn_one = len(proxy.seen)
        second = run(["claude", "-p", "--continue", "Have a helper check made.txt. CLAUDE-HELPER-1", *CLAUDE_ARGS],
                     setup, env, outside, proxy)
    for ran in (first, second):
        assert ran.rc is not None, f"claude did not finish: {ran.said()}"
        result = json.loads(ran.out)
        assert result["is_error"] is False and DONE in result["result"], result
    assert made(setup)
    models = [str((s.body or {}).get("model")) for s in proxy.seen]
    opening = proxy.seen[0].body or {}
    assert {s.path.split("?")[0] for s in proxy.seen} == {"/v1/messages"}, [s.path for s in proxy.seen]
    assert all(s.status == 200 for s in proxy.seen), list(zip(models, [s.status for s in proxy.seen]))
    assert "Bash" in [t["name"] for t in opening["tools"]]
    # its default output limit passes the context (a ~34k prompt in 40,960): clamped, not refused
    assert opening["max_tokens"] + 30000 > 40960
    assert [m for m in models if "haiku" in m], f"no request named its small model: {models}"
    # whatever it sent the daemon came through the proxy; what it tried outside (telemetry) was refused
    assert len(REQUEST_LINE.findall(daemon_log(setup))) == len(proxy.seen), models
    assert not [a for a in outside.attempts if "127.0.0.1" in a or "localhost" in a], outside.attempts
    # one worker over the whole run, for every name asked for
    assert LOADED.findall(daemon_log(setup, 0)) == ["qwen3"], f"workers loaded for {models}: {daemon_log(setup)}"
    assert [(m["id"], m["restarts"]) for m in models_now(setup) if m["pid"]] == [("qwen3", 0)]
    # the second turn's main requests read the first's prompt from the hot cache
    cached = [usage_of(s).get("cache_read_input_tokens", 0)
              for s, m in zip(proxy.seen[turn_one:], models[turn_one:]) if m == models[0]]
    assert cached and all(c > 0 for c in cached), (cached, models)


def test_codex_runs_its_exec_command_tool(setup: Setup) -> None:
    (setup.home / ".codex").mkdir()
    with RecordingProxy(setup.daemon.url) as proxy, OutsideRefused() as outside:
        (setup.home / ".codex" / "config.toml").write_text(
            # plugins off: else it syncs plugin catalogs from github.com and chatgpt.com at startup
            'model = "qwen3"\nmodel_provider = "mlxsup"\ncheck_for_update_on_startup = false\n'
            '[features]\nplugins = false\n[analytics]\nenabled = false\n[model_providers.mlxsup]\nname = "mlxsup"\n'
            f'base_url = "{proxy.url}/v1"\nenv_key = "MLXSUP_KEY"\nwire_api = "responses"\n')
        ran = run(["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                   "Create the file made.txt. CODEX-STEP-1"], setup, {"MLXSUP_KEY": KEY}, outside, proxy)
    assert ran.rc == 0, ran.said()
    assert DONE in ran.out and made(setup)
    assert {s.path for s in proxy.seen} == {"/v1/responses"} and len(proxy.seen) >= 2
    assert "client_metadata" in proxy.seen[0].body and all(s.status == 200 for s in proxy.seen)
    assert outside.attempts == [], outside.attempts


def test_opencode_runs_its_bash_tool(setup: Setup) -> None:
    model: dict = {"name": "qwen3"}
    config = setup.home / "opencode.json"
    with RecordingProxy(setup.daemon.url) as proxy, OutsideRefused() as outside:
        config.write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "model": "mlxsup/qwen3",
            "provider": {"mlxsup": {"npm": "@ai-sdk/openai-compatible", "name": "mlxsup",
                                    "options": {"baseURL": f"{proxy.url}/v1", "apiKey": "{env:MLXSUP_KEY}"},
                                    "models": {"qwen3": model}}}}))
        env = {"MLXSUP_KEY": KEY, "OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
               "OPENCODE_DISABLE_AUTOUPDATE": "1"}
        # a refused request makes it compact its history and retry, forever: a refusal is no progress, so the
        # quiet period ends that
        ran = run(["opencode", "run", "--model", "mlxsup/qwen3", "Create the file made.txt. OPENCODE-STEP-1"], setup,
                  env, outside, proxy)
    assert ran.rc == 0, ran.said()
    assert DONE in ran.out and made(setup)
    assert {s.path for s in proxy.seen} == {"/v1/chat/completions"}
    # its default max_tokens (32000) passes the context with its ~21k prompt: clamped, not refused
    assert max(s.body["max_tokens"] for s in proxy.seen if s.body) == 32000 and all(s.status == 200 for s in proxy.seen)
    # it tries to install its provider package at run time, then goes on with the one it bundles
    assert set(outside.attempts) <= {"registry.npmjs.org:443"}


def test_continue_runs_its_bash_tool(setup: Setup) -> None:
    """Continue's CLI in headless mode (`cn -p`), its model an OpenAI provider in ~/.continue/config.yaml: headless,
    its Bash tool runs without asking."""
    (setup.home / ".continue").mkdir()
    with RecordingProxy(setup.daemon.url) as proxy, OutsideRefused() as outside:
        (setup.home / ".continue" / "config.yaml").write_text(
            "name: mlxsup\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: qwen3\n    provider: openai\n"
            f"    model: qwen3\n    apiBase: {proxy.url}/v1\n    apiKey: {KEY}\n")
        ran = run(["cn", "-p", "Create the file made.txt. CONTINUE-STEP-1"], setup, {}, outside, proxy)
    assert ran.rc == 0, ran.said()
    assert DONE in ran.out and made(setup)
    assert {s.path for s in proxy.seen} == {"/v1/chat/completions"} and len(proxy.seen) == 2
    opening = proxy.seen[0].body or {}
    assert opening["stream"] is True and "Bash" in [t["function"]["name"] for t in opening["tools"]]
    # the tool's output came back to the model as a tool message
    assert [m for m in (proxy.seen[1].body or {})["messages"] if m["role"] == "tool"]
    assert all(s.status == 200 for s in proxy.seen) and outside.attempts == [], outside.attempts


def test_aider_applies_its_search_replace_edit(aider_setup: Setup) -> None:
    """aider with its model in ~/.aider.conf.yml (an OpenAI-compatible base URL and key) and the model's window in
    ~/.aider.model.metadata.json, run with `--message`: the model's SEARCH/REPLACE block edits greeting.txt in
    place, leaving its other lines as they were."""
    s = aider_setup
    (s.work / "greeting.txt").write_text(GREETING)
    with RecordingProxy(s.daemon.url) as proxy, OutsideRefused() as outside:
        (s.home / ".aider.conf.yml").write_text(
            f"model: openai/qwen3\nopenai-api-base: {proxy.url}/v1\nopenai-api-key: {KEY}\nedit-format: diff\n"
            "check-update: false\nshow-release-notes: false\nanalytics: false\n")
        # without it aider fetches litellm's model list from GitHub for the window (and warns it knows none)
        (s.home / ".aider.model.metadata.json").write_text(json.dumps({"openai/qwen3": {
            "max_input_tokens": 40960, "max_output_tokens": 8192, "input_cost_per_token": 0,
            "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}))
        # LITELLM_LOCAL_MODEL_COST_MAP: else litellm fetches that list too, at import
        ran = run(["aider", "--no-git", "--yes-always", "--message", "Change the greeting. AIDER-EDIT-1",
                   "greeting.txt"], s, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, outside, proxy)
    assert ran.rc == 0, ran.said()
    assert (s.work / "greeting.txt").read_text() == GREETING.replace("hello", AIDER_EDIT)
    assert DONE in ran.out and "Applied edit to greeting.txt" in ran.out, ran.out[-3000:]
    # one request (an edit that failed to apply would be sent back to the model), streamed, no tools
    assert [s.path for s in proxy.seen] == ["/v1/chat/completions"] and proxy.seen[0].status == 200
    body = proxy.seen[0].body or {}
    assert body["stream"] is True and "tools" not in body and "greeting.txt" in json.dumps(body["messages"])
    assert outside.attempts == [], outside.attempts
