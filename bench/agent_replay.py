"""Replay recorded coding-agent sessions against the daemon and measure what the prompt caches save.

    .venv/bin/python -m bench.agent_replay [--families llama,qwen3,qwen3_5,gemma3,gpt_oss] [--preset tiny]
        [--programs claude,codex,opencode] [--modes plain,ssd,interleaved] [--cold first,2,last|all|none]
        [--models DIR] [--server mlx_lm] [--out bench/results/cpu/agent_replay]

For each family a daemon (hot and SSD caches on) serves a `make-model` model whose worker answers from a script
(worker/mlx_engine/scripted.py). The recorded requests (tests/fixtures/agent_traffic/, bench/agent_traffic.py)
are sent in order, streamed, as the program sent them. Request k's reply is what the family's own template
renders for the assistant turn that request k+1 carries (the reply a model whose output the template reproduces
would give); where no later request shows it, the recorded qwen3 reply. Modes:
- plain: each program's session alone (caches cleared between programs);
- ssd: the same, with the model evicted (worker gone, hot cache with it) after the session's middle request and
  loaded again by the next one, so the rest of the session reads from the SSD tier;
- interleaved: four copies of each program's session (each copy's first user text tagged, as an agent's
  subagents differ) sent round-robin, one request of each in turn.

With `--server mlx_lm`, each program's session is also sent to mlx_lm.server (bench/servers.py) on the same model
in the same run, after the daemon is stopped: TTFT per turn against its own prompt cache (mode `mlx_lm`).

Per request: prompt tokens (the worker's own encoding, offline: bench/agent_traffic.py), `shared` (the longest
token prefix shared with any earlier request of the run since the caches were cleared, its reply included: what
its worker ran), `cached` (usage),
`prefilled` (prompt - cached), `excess` (prefilled - (prompt - shared): what the caches missed that they could
have had; the goal is <= one block), TTFT, and for the `--cold` turns the same request again with both tiers
cleared. TTFT is the time to the first generated token on both sides alike: each turn is first sent with one token
out (max_tokens 1, as the mlx_lm side is), timed to its end, and its usage is the turn's; then the same request
whole, untimed, so the scripted reply is produced and cached as the real session's was (its prompt is then a hit).
A reply's first content event would be no first token: one that opens with a tool call shows nothing until the
whole call is decoded. Writes results.json and results.md to --out; `--logs DIR` keeps each family's daemon log
and worker logs (the worker at debug level) there. Every process started is stopped and proven gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from bench.agent_traffic import PROGRAMS, Recorded, load, submit_of
from bench.cache_bench import Daemon, machine
from worker.engine_api import RequestRejected

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen3", "qwen3_5", "gemma3", "gpt_oss")
CONTEXT = 65536  # every recorded prompt fits (Claude Code's are ~35k); tiny presets' own limits are smaller
BLOCK = 64
KEY = "sk-replay"


class Skipped(Exception):
    """A family that cannot serve the recorded traffic (a template without tools, or one that rejects the roles)."""


@dataclass
class Turn:
    mode: str
    session: str
    turn: int
    path: str
    prompt: int
    shared: int
    cached: int
    prefilled: int
    excess: int
    ttft_s: float
    cold_ttft_s: float | None = None
    cold_prefilled: int | None = None


def prepare_model(family: str, preset: str, models: Path | None, work: Path) -> Path:
    """A make-model folder for `family`, its context raised to CONTEXT (random weights: positions are free)."""
    src = models / family if models is not None else work / f"{family}-made"
    if models is None:
        subprocess.run([sys.executable, "-m", "supervisor", "make-model", str(src), "--arch", family, "--preset",
                        preset], check=True, capture_output=True, cwd=ROOT)
    dst = work / family
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((dst / "config.json").read_text())
    for c in (config, config.get("text_config") or {}):
        if "max_position_embeddings" in c:
            c["max_position_embeddings"] = max(c["max_position_embeddings"], CONTEXT)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


class Encoder:
    """Requests as the worker's token ids and the rendered text, by the model's own tokenizer and template."""

    def __init__(self, model: Path) -> None:
        from mlx_lm.utils import load_tokenizer

        from worker.mlx_engine.prompt import Prompts
        self.tokenizer = load_tokenizer(model)
        self.prompts = Prompts(self.tokenizer, 0, CONTEXT, False)
        self.eos = {self.tokenizer.eos_token_id, *getattr(self.tokenizer, "eos_token_ids", ())}
        for name in ("config.json", "generation_config.json"):  # the worker's stop tokens (Gemma 3's <end_of_turn>)
            f = model / name
            ids = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
            self.eos |= set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        # gpt-oss ends a turn that calls a tool with <|call|>, its other stop token (a made model lists <|return|> only)
        call = self.tokenizer.get_vocab().get("<|call|>")
        self.turn_end = self.eos | ({call} if call is not None else set())

    def ids(self, r: Recorded) -> list[int]:
        return self.prompts.encode(submit_of(r.path, r.body))

    def replies(self, session: list[Recorded]) -> dict[str, str]:
        """marker -> the reply this family's model gives that request: the tokens the next request that extends
        its prompt carries after it, up to the end of turn (the assistant turn as the template renders it in
        context, so a reply the template later re-renders differently is not counted against the caches)."""
        out: dict[str, str] = {}
        derived: set[str] = set()  # markers whose reply a later request shows (opencode's title request shares one)
        ids = [self.ids(r) for r in session]
        for k, r in enumerate(session):
            if r.marker is None or r.marker in derived:
                continue
            later = next((b for b in ids[k + 1:] if len(b) > len(ids[k]) and b[:len(ids[k])] == ids[k]), None)
            reply = None
            if later is not None:
                tail = later[len(ids[k]):]
                end = next((n for n, t in enumerate(tail) if t in self.turn_end), None)
                reply = self.tokenizer.decode(tail[:end + 1] if end is not None else tail)
            if reply:
                derived.add(r.marker)
            out[r.marker] = reply or out.get(r.marker) or r.reply or "Done."
        return out

    def reply_ids(self, reply: str) -> list[int]:
        """The tokens the scripted worker forces for `reply` (worker/mlx_engine/scripted.py): its encoding, then EOS."""
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        return ids if ids and ids[-1] in self.eos else [*ids, self.tokenizer.eos_token_id]


def shared_prefix(ids: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for e in earlier:
        n, m = 0, min(len(e), len(ids))
        while n < m and e[n] == ids[n]:
            n += 1
        best = max(best, n)
    return best


def send(d: Daemon, r: Recorded, body: dict) -> tuple[float, dict]:
    """Seconds to the end of one streamed request, and its usage."""
    headers = {"x-api-key": KEY, "Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    t0, usage = time.perf_counter(), {}
    with d.http.stream("POST", r.path, json={**body, "stream": True}, headers=headers) as resp:
        if resp.status_code == 400:  # the model cannot serve it (a template with no tools): nothing to measure
            raise Skipped(f"{r.path} -> 400: {resp.read()[:500].decode(errors='replace')}")
        if resp.status_code != 200:
            raise SystemExit(f"{r.path} -> {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for u in (event.get("usage"), (event.get("message") or {}).get("usage"),
                      (event.get("response") or {}).get("usage")):
                if u:
                    usage.update(u)
    return time.perf_counter() - t0, usage


def capped(r: Recorded, body: dict, tokens: int) -> dict:
    """`body` with its output cut to `tokens` (each API's own field)."""
    return {**body, "max_output_tokens" if r.path.startswith("/v1/responses") else "max_tokens": tokens}


def body_of(r: Recorded) -> dict:
    """The body to send: as recorded, but a request the script does not answer (a side request: opencode's title)
    generates freely, so its output is cut short rather than run to the context's end."""
    return r.body if r.marker is not None else capped(r, r.body, 16)


def first_token(d: Daemon, r: Recorded) -> tuple[float, dict]:
    """TTFT: the whole request with one token out, as mlx_lm.server's side is timed. A reply's first content event
    is no first token: one that opens with a tool call shows nothing until the whole call is decoded."""
    return send(d, r, capped(r, r.body, 1))


def counts(usage: dict) -> tuple[int, int]:
    """(prompt tokens, cached tokens) from any API's usage."""
    if "input_tokens_details" in usage:  # Responses
        return usage["input_tokens"], usage["input_tokens_details"].get("cached_tokens", 0)
    if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens excludes what the caches read
        read = usage.get("cache_read_input_tokens", 0)
        return usage["input_tokens"] + read + usage.get("cache_creation_input_tokens", 0), read
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def clear(d: Daemon) -> None:
    for which in ("hot", "ssd"):
        d.http.post(f"/api/{which}-cache/clear", json={}, headers={"Authorization": f"Bearer {KEY}"})


def settle_ssd(d: Daemon, model: str, timeout: float = 120) -> None:
    """Wait until the SSD tier stops growing (its writer has drained what the session stored)."""
    deadline, last, still = time.monotonic() + timeout, -1, 0
    while time.monotonic() < deadline and still < 5:
        entries = (d.model(model).get("cache") or {}).get("ssd", {}).get("entries", 0)
        still, last = (still + 1, last) if entries == last else (0, entries)
        time.sleep(0.2)


def run_session(d: Daemon, enc: Encoder, mode: str, sessions: dict[str, list[Recorded]], cold: set,
                evict_after: int | None, script: dict[str, str]) -> list[Turn]:
    """Send the sessions' requests (round-robin when several), measuring each; caches cleared first."""
    clear(d)
    order = [(name, k) for k in range(max(len(s) for s in sessions.values())) for name in sessions
             if k < len(sessions[name])]
    earlier: list[list[int]] = []
    turns = []
    for name, k in order:
        r = sessions[name][k]
        ids = enc.ids(r)
        shared = shared_prefix(ids, earlier)
        earlier.append(ids + enc.reply_ids(script[r.marker]) if r.marker in script else ids)  # what its worker ran
        ttft, usage = first_token(d, r)  # what this turn prefills and reads, as the real request would
        send(d, r, body_of(r))  # then the reply, produced and cached as the real session's (its prompt: a hit)
        prompt, cached = counts(usage)
        prefilled = prompt - cached
        turns.append(Turn(mode, name, k + 1, r.path.split("?")[0], prompt, shared, cached, prefilled,
                          prefilled - (prompt - shared), round(ttft, 3)))
        if prompt != len(ids):
            print(f"  warning: {name} turn {k + 1}: usage says {prompt} prompt tokens, the encoding {len(ids)}")
        if evict_after is not None and k + 1 == evict_after:
            settle_ssd(d, "m")
            d.post("/api/models/m/evict")
    for t in turns:  # the same requests cold, both tiers empty, after the warm run (so they cannot feed it)
        if t.turn in cold or (-1 in cold and t.turn == len(sessions[t.session])) or "all" in cold:
            clear(d)
            ttft, usage = first_token(d, sessions[t.session][t.turn - 1])
            prompt, cached = counts(usage)
            t.cold_ttft_s, t.cold_prefilled = round(ttft, 3), prompt - cached
    return turns


def tagged(session: list[Recorded], tag: str) -> list[Recorded]:
    """The session with its first user text prefixed by `tag` in every request (a distinct sibling session)."""
    out = []
    for r in session:
        body = json.loads(json.dumps(r.body))
        for m in body.get("messages") or body.get("input") or []:  # Chat and Anthropic; Responses
            if m.get("role") == "user":
                if isinstance(m["content"], str):
                    m["content"] = f"{tag} {m['content']}"
                else:
                    texts = [p for p in m["content"] if p.get("type") in ("text", "input_text")]
                    texts[-1]["text"] = f"{tag} {texts[-1]['text']}"
                break
        out.append(Recorded(r.i, r.path, body, r.marker, r.reply))
    return out


def run_mlx_lm(model: Path, enc: Encoder, recorded: dict[str, list[Recorded]], work: Path) -> list[Turn]:
    """The same sessions against mlx_lm.server (its own prompt cache), each program's in order: the prompt as this
    family's template renders it, as text to /v1/completions, one token out (its TTFT: the request's time).
    Its usage gives prompt and cached tokens (its own tokenization of that text); `shared` and `excess`: -1."""
    import asyncio

    from bench.servers import MlxLmServer

    server = MlxLmServer(model, work / "mlx_lm.log")
    turns: list[Turn] = []
    try:
        asyncio.run(server.start(300))
        http = httpx.Client(base_url=server.url, timeout=3600, trust_env=False)
        for program, session in recorded.items():
            for k, r in enumerate(session):
                ids = enc.ids(r)
                t0 = time.perf_counter()
                resp = http.post("/v1/completions", json={"model": str(model), "prompt": enc.tokenizer.decode(ids),
                                                          "max_tokens": 1, "temperature": 0})
                ttft = time.perf_counter() - t0
                if resp.status_code != 200:
                    raise SystemExit(f"mlx_lm.server -> {resp.status_code}: {resp.text[:500]}")
                prompt, cached = counts(resp.json().get("usage") or {"prompt_tokens": -1})
                turns.append(Turn("mlx_lm", program, k + 1, r.path.split("?")[0], prompt, -1, cached, prompt - cached,
                                  -1, round(ttft, 3)))
            print(f"mlx_lm {program}: done")
    finally:
        proof = asyncio.run(server.stop())
        if "ALIVE" in proof["pids"].values():
            raise SystemExit(f"mlx_lm.server left running: {proof}")
    return turns


def run_family(family: str, args: argparse.Namespace, work: Path, save: Callable[[list[Turn]], None]) -> None:
    """The family's replay: its turns `save`d once the daemon's are done, again with mlx_lm.server's (a run cut short
    meanwhile keeps the daemon's)."""
    model = prepare_model(family, args.preset, args.models, work)
    enc = Encoder(model)
    recorded = {p: load(p) for p in args.programs}
    script = {}
    for program, session in recorded.items():
        kept = []
        for r in session:  # a request the template refuses (opencode's title request to Gemma 3): the worker's 400
            try:
                enc.ids(r)
                kept.append(r)
            except RequestRejected as exc:
                print(f"{family} {program}: a {r.path} request left out, the worker refuses it: {exc}")
        if not kept:
            raise Skipped(f"the worker refuses every request of {program}'s session")
        recorded[program] = kept
        script.update(enc.replies(kept))
    (work / f"{family}-script.json").write_text(json.dumps([{"match": m, "reply": r} for m, r in script.items()]))
    config = work / f"{family}.toml"
    worker_args = ["--script", str(work / f"{family}-script.json"), *(["--log-level", "DEBUG"] if args.logs else [])]
    # the names the programs asked for, as aliases: the chat API maps no unknown name (model_aliases is the agents')
    names = json.dumps(sorted({r.body["model"] for s in recorded.values() for r in s if r.body.get("model")}))
    config.write_text(f'[server]\napi_key = "{KEY}"\ndefault_model = "m"\n[server.model_aliases]\n"*" = "m"\n'
                      f'[models.m]\npath = "{model}"\naliases = {names}\n'
                      f'worker_args = {json.dumps(worker_args)}\n'
                      f'[cache]\nhot_budget = "{args.hot}"\nssd_dir = "{work / f"{family}-ssd"}"\n')
    d = Daemon(work / f"{family}-state", config)
    d.http.headers["Authorization"] = f"Bearer {KEY}"  # the admin API asks for the key too
    cold = {"all"} if args.cold == "all" else set() if args.cold == "none" else \
        {-1 if c == "last" else 1 if c == "first" else int(c) for c in args.cold.split(",")}
    turns: list[Turn] = []
    try:
        for mode in args.modes:
            for program, session in recorded.items():
                if mode == "interleaved":
                    copies = {f"{program}-s{i}": tagged(session, f"[s{i}]") for i in range(4)}
                    turns += run_session(d, enc, mode, copies, set(), None, script)
                    continue
                half = len(session) // 2 if mode == "ssd" else None
                turns += run_session(d, enc, mode, {program: session}, cold if mode == "plain" else set(), half,
                                     script)
            print(f"{family} {mode}: done")
    finally:
        pids = [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)]
        d.stop()
        gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=30)[1]
        if args.logs is not None:
            keep_logs(d.state, args.logs / family)
        if gone:
            raise SystemExit(f"left running: {[p.pid for p in gone]}")
    save(turns)
    if args.server == "mlx_lm":
        save(turns + run_mlx_lm(model, enc, recorded, work))


def keep_logs(state: Path, dest: Path) -> None:
    """The daemon's log and its workers' (state/logs/) copied to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in [state / "daemon.log", *sorted((state / "logs").glob("*"))]:
        if log.is_file():
            shutil.copyfile(log, dest / log.name)


def markdown(results: dict) -> str:
    lines = [f"# Agent session replay (issue 34)\n\n`{results['command']}`  \nmlxsup {results['commit']}, "
             f"{results['machine']['cpu']} ({results['machine']['cores']} cores), preset `{results['preset']}`, "
             f"block {BLOCK} tokens. `excess` = prefilled - (prompt - shared): tokens the caches could have "
             "served and did not (goal: <= one block on every turn after the first). TTFT: the turn sent with "
             "max_tokens 1, to its end (the mlx_lm side alike).\n"]
    for family, why in results.get("skipped", {}).items():
        lines.append(f"\n## {family}: not replayed\n\n{why}\n")
    for family, turns in results["families"].items():
        worst = max((t["excess"] for t in turns if t["turn"] > 1), default=0)
        lines.append(f"\n## {family} (worst excess after turn 1: {worst})\n")
        lines.append("| mode | session | turn | endpoint | prompt | shared | cached | prefilled | excess | TTFT s | "
                     "cold TTFT s |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for t in turns:
            cold = "" if t["cold_ttft_s"] is None else f"{t['cold_ttft_s']}"
            flag = " **" if t["excess"] > BLOCK else ""
            lines.append(f"| {t['mode']} | {t['session']} | {t['turn']} | {t['path']} | {t['prompt']} | "
                         f"{t['shared']} | {t['cached']} | {t['prefilled']} | {t['excess']}{flag} | {t['ttft_s']} | "
                         f"{cold} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--modes", default="plain,ssd,interleaved")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--cold", default="first,2,last", help="turns also measured cold: first,2,last | all | none")
    ap.add_argument("--hot", default="1GiB", help="hot tier budget")
    ap.add_argument("--server", choices=("mlx_lm",), help="also replay each program's session against this server")
    ap.add_argument("--models", type=Path, help="a folder of make-model folders named by family (else made here)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "agent_replay")
    ap.add_argument("--logs", type=Path, help="keep each family's daemon and worker logs (worker at debug) here")
    args = ap.parse_args()
    args.programs, args.modes = args.programs.split(","), args.modes.split(",")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results: dict = {"command": " ".join(["python -m bench.agent_replay", *sys.argv[1:]]),
                     "commit": commit.stdout.strip(), "preset": args.preset, "machine": machine(), "families": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agent-replay-") as tmp:
        for family in args.families.split(","):
            t0 = time.perf_counter()

            def save(turns: list[Turn], family: str = family) -> None:
                results["families"][family] = [asdict(t) for t in turns]
                write(results, args.out)

            try:
                run_family(family, args, Path(tmp), save)
            except Skipped as exc:
                results.setdefault("skipped", {})[family] = str(exc)
                print(f"{family}: skipped: {exc}")
                write(results, args.out)
            print(f"{family}: {time.perf_counter() - t0:.0f} s")
    print(f"-> {args.out / 'results.md'}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # a `timeout` around the replay (the GPU script) ends it by SIGTERM: unwind, so the daemon, its workers and
    # mlx_lm.server are stopped and the logs kept by the `finally`s, not left running for the next family
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
