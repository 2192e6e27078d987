"""Record what Claude Code, Codex and opencode send during a scripted coding session (issue 34), as fixtures.

    .venv/bin/python -m tests.tools.record_agent_traffic [--programs claude,codex,opencode] [--out DIR]

Run by hand, not in CI (the programs are installed as tests/agents/conftest.py's `agent_bin` does; ~5 min on
2 cores). Each program runs the same session against a daemon whose tiny qwen3 answers from a script
(worker/mlx_engine/scripted.py) through the recording proxy of tests/agents/proxy.py: ten tool calls (shell
commands, two file reads, an edit) and a final answer in one invocation, then a second user prompt in the same
conversation (the program's own continue), one more tool call and an answer; some replies carry reasoning.
Every request the program sends is kept (side requests too), one JSON line each, in
tests/fixtures/agent_traffic/<program>.jsonl (format: bench/agent_traffic.py).

Each step's reply is chosen by a marker (`CLAUDE-S03`...) that the previous tool's output prints; the script
lists the markers highest first, so a result showing an older marker too still picks its own step.
Normalised so that nothing machine-specific stays: the scratch folder, user and host names, dates, uuids, long
hex ids, the ids the daemon made up (`toolu_...`), the programs' versions; each distinct value becomes one
numbered placeholder of the same shape, so what was equal between requests stays equal and what differed differs.
"""

from __future__ import annotations

import argparse
import getpass
import json
import platform
import re
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.agent_traffic import FIXTURES, submit_of
from tests.agents.conftest import DONE, KEY, tool_call
from tests.agents.proxy import OutsideRefused, RecordingProxy
from tests.agents.test_programs import Setup, run
from tests.conftest import MLXSUP, start_daemon
from worker.mlx_engine.scripted import Script

NOTES = "Project notes\nThe app prints a number. It should print 2, not 1.\nNext: {P}-S03\n"
APP = "def answer():\n    return 1  # TODO: {P}-S05\n\n\nprint(answer())\n"
VERSIONS = {"claude": "2.1.332", "codex": "0.171.0", "opencode": "1.18.33"}  # tests/agents/package.json


def think(text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n"


def steps(p: str, shell: Callable[[str], str], read: Callable[[str], str], edit: Callable[[str, str, str], str],
          work: Path) -> list[tuple[str, str]]:
    """(marker, reply) of the session's steps, highest marker first."""
    app, notes = str(work / "app.py"), str(work / "notes.txt")
    return [
        (f"{p}-S12", think("The user has what they asked for.") + f"Here is the final app. {DONE}"),
        (f"{p}-S11", shell(f"cat app.py && echo {p}-S12")),
        (f"{p}-S10", think("Everything checks out; time to answer.") + f"The app now prints 2. {DONE}"),
        (f"{p}-S09", shell(f"cat result.txt && echo {p}-S10")),
        (f"{p}-S08", think("Write down the result.") + shell(f"echo checked > result.txt && echo {p}-S09")),
        (f"{p}-S07", shell(f"wc -l app.py notes.txt && echo {p}-S08")),
        (f"{p}-S06", think("The edit is in; run it.") + shell(f"python3 app.py && echo {p}-S07")),
        (f"{p}-S05", edit(app, f"return 1  # TODO: {p}-S05", f"return 2  # {p}-S06 fixed")),
        (f"{p}-S04", read(app)),
        (f"{p}-S03", think("The notes say what to fix; find the function.") + shell(f"grep -n def app.py && echo {p}-S04")),
        (f"{p}-S02", read(notes)),
        (f"{p}-S01", think("I should look at the files first.") + shell(f"ls && echo {p}-S02")),
    ]


def script_of(program: str, work: Path) -> list[tuple[str, str]]:
    p = program.upper()
    if program == "claude":
        return steps(p, lambda c: tool_call("Bash", {"command": c, "description": "Run a command"}),
                     lambda f: tool_call("Read", {"file_path": f}),
                     lambda f, a, b: tool_call("Edit", {"file_path": f, "old_string": a, "new_string": b}), work)
    if program == "codex":
        return steps(p, lambda c: tool_call("exec_command", {"cmd": c}),
                     lambda f: tool_call("exec_command", {"cmd": f"cat {f}"}),
                     lambda f, a, b: tool_call("exec_command", {"cmd": f"sed -i 's/{a}/{b}/' {f} && grep -n fixed {f}"}),
                     work)
    return steps(p, lambda c: tool_call("bash", {"command": c, "description": "Run a command"}),
                 lambda f: tool_call("read", {"filePath": f}),
                 lambda f, a, b: tool_call("edit", {"filePath": f, "oldString": a, "newString": b}), work)


# an edit's result may not show the edited line (so no marker): the program's own words then pick step 6
EDITED = {"claude": "has been updated", "opencode": "Edit applied successfully"}


def full_script(work: Path, programs: list[str]) -> list[dict]:
    entries: list[dict] = []
    for program in programs:
        marked = script_of(program, work)
        entries += [{"match": m, "reply": r} for m, r in marked]
        if program in EDITED:
            entries.append({"match": EDITED[program], "reply": dict(marked)[f"{program.upper()}-S06"]})
    return entries


def invocations(program: str, s: Setup, url: str) -> tuple[list[list[str]], dict[str, str]]:
    """The program's two command lines (first prompt, then the continued conversation) and its environment."""
    p = program.upper()
    first = f"Fix app.py so that it prints 2; read notes.txt first. {p}-S01"
    then = f"Show me the final app.py. {p}-S11"
    if program == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}
        tail = ["--output-format", "json", "--allowedTools", "Bash,Read,Edit"]
        return [["claude", "-p", first, *tail], ["claude", "--continue", "-p", then, *tail]], env
    if program == "codex":
        (s.home / ".codex").mkdir(exist_ok=True)
        (s.home / ".codex" / "config.toml").write_text(
            'model = "qwen3"\nmodel_provider = "mlxsup"\ncheck_for_update_on_startup = false\n'
            '[features]\nplugins = false\n[analytics]\nenabled = false\n[model_providers.mlxsup]\nname = "mlxsup"\n'
            f'base_url = "{url}/v1"\nenv_key = "MLXSUP_KEY"\nwire_api = "responses"\n')
        flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        return [["codex", "exec", *flags, first], ["codex", "exec", *flags, "resume", "--last", then]], \
            {"MLXSUP_KEY": KEY}
    config = s.home / "opencode.json"
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "model": "mlxsup/qwen3",
        "provider": {"mlxsup": {"npm": "@ai-sdk/openai-compatible", "name": "mlxsup",
                                "options": {"baseURL": f"{url}/v1", "apiKey": "{env:MLXSUP_KEY}"},
                                "models": {"qwen3": {"name": "qwen3"}}}}}))
    env = {"MLXSUP_KEY": KEY, "OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    return [["opencode", "run", "--model", "mlxsup/qwen3", first],
            ["opencode", "run", "--continue", "--model", "mlxsup/qwen3", then]], env


class Normaliser:
    """Machine-specific values to numbered placeholders, the same value always to the same placeholder."""

    def __init__(self, scratch: Path) -> None:
        self.fixed = {str(scratch): "/tmp/session", str(scratch).replace("/", "-"): "-tmp-session",  # Claude's ~/.claude/projects/<path>
                      getpass.getuser(): "user", socket.gethostname(): "host",
                      platform.release(): "6.0.0", **{v: "0.0.0" for v in VERSIONS.values()}}
        self.seen: dict[str, str] = {}
        self.patterns: list[tuple[re.Pattern, Callable[[int, str], str]]] = [
            (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
             lambda n, v: f"00000000-0000-4000-8000-{n:012d}"),
            (re.compile(r"\b(toolu|call|fc|msg|resp|rs|chatcmpl|ctc)_[A-Za-z0-9]{8,}"),
             lambda n, v: f"{v.split('_')[0]}_{n:024d}"),
            (re.compile(r"\b[0-9a-f]{32,}\b"), lambda n, v: f"{n:0{len(v)}x}"),
            (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), lambda n, v: f"2000-01-{n:02d}"),
            (re.compile(r"\b20\d\d/[01]\d/[0-3]\d\b"), lambda n, v: f"2000/01/{n:02d}"),
            (re.compile(r"\b[0-2]\d:[0-5]\d:[0-5]\d\b"), lambda n, v: f"00:00:{n % 60:02d}"),
        ]

    def text(self, s: str) -> str:
        for value in sorted(self.fixed, key=len, reverse=True):
            if value and len(value) > 2:
                s = s.replace(value, self.fixed[value])
        for pattern, make in self.patterns:
            s = pattern.sub(lambda m, make=make: self._one(m.group(0), make), s)  # type: ignore[misc]
        return s

    def _one(self, value: str, make: Callable[[int, str], str]) -> str:
        if value not in self.seen:
            self.seen[value] = make(sum(1 for v in self.seen.values() if v[:3] == make(0, value)[:3]) + 1, value)
        return self.seen[value]

    def value(self, v: object) -> object:
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k): self.value(x) for k, x in v.items()}
        return v


def record(program: str, daemon_url: str, scratch: Path, bin_dir: Path, script: Script, log_from: int,
           daemon) -> list[dict]:
    s = Setup(scratch / "home", scratch / "work", bin_dir, daemon, log_from)
    s.home.mkdir(parents=True)
    s.work.mkdir(parents=True)
    p = program.upper()
    (s.work / "notes.txt").write_text(NOTES.format(P=p))
    (s.work / "app.py").write_text(APP.format(P=p))
    with RecordingProxy(daemon_url) as proxy, OutsideRefused() as outside:
        argvs, env = invocations(program, s, proxy.url)
        for argv in argvs:
            ran = run(argv, s, env, outside, timeout=900)
            if ran.rc != 0 or DONE not in ran.out:
                raise SystemExit(f"{program} failed ({ran.rc}):\n{ran.out[-2000:]}\n{ran.err[-3000:]}")
    if "2  #" not in (s.work / "app.py").read_text():
        raise SystemExit(f"{program} did not edit app.py")
    norm = Normaliser(scratch)
    out = []
    for i, seen in enumerate(proxy.seen):
        if seen.body is None:
            continue
        submit = submit_of(seen.path, seen.body)
        marker = next((m for m, _ in script.entries if m in _latest(submit.messages or [])), None)
        reply = script.reply_for(submit.messages or [])
        out.append({"i": i, "path": seen.path, "marker": marker, "reply": norm.text(reply) if reply else None,
                    "body": norm.value(seen.body)})
    return out


def _latest(messages: list[dict]) -> str:
    from worker.mlx_engine.scripted import latest_turn_text
    return latest_turn_text(messages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default="claude,codex,opencode")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--model", type=Path, help="a tiny qwen3 made by `mlxsup make-model` (default: made here)")
    args = ap.parse_args()
    programs = args.programs.split(",")
    from tests.agents.conftest import agent_bin
    bin_dir = agent_bin.__wrapped__()  # type: ignore[attr-defined]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agent-rec-") as tmp:
        root = Path(tmp)
        model = args.model or root / "qwen3"
        if args.model is None:
            subprocess.run([*MLXSUP, "make-model", str(model), "--arch", "qwen3", "--preset", "tiny"], check=True,
                           capture_output=True)
        entries = []
        for program in programs:  # every program's work folder is known before the daemon reads the script
            entries += full_script(root / program / "work", [program])
        (root / "script.json").write_text(json.dumps(entries))
        script = Script.load(root / "script.json")
        config = root / "mlxsup.toml"
        config.write_text(f'[server]\napi_key = "{KEY}"\ndefault_model = "qwen3"\n'
                          '[server.model_aliases]\n"claude-*" = "qwen3"\n'
                          f'[models.qwen3]\npath = "{model}"\nworker_args = ["--script", "{root / "script.json"}"]\n')
        daemon = start_daemon(root / "state", "--config", str(config))
        try:
            for program in programs:
                log_from = (daemon.state_dir / "daemon.log").stat().st_size
                lines = record(program, daemon.url, root / program, bin_dir, script, log_from, daemon)
                path = args.out / f"{program}.jsonl"
                path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
                print(f"{program}: {len(lines)} requests, {path.stat().st_size} bytes -> {path}")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
