"""A cold long prompt's time to first token through mlxsup against mlx-lm in-process, and where the daemon's goes.

    python -m bench.cold_prefill --preset small --tokens 2048 --out bench/results/cpu/cold_prefill

Each round, in alternating order:
  inproc  a fresh process: `mlx_lm.load`, then `stream_generate(prompt, max_tokens=1)` with mlx-lm's own
          prefill_step_size (generate_step's default): the first token's time from the call, the load apart;
  mlxsup  a fresh daemon (`python -m supervisor serve --port 0 --config ...`, default settings, its prompt caches on,
          nothing cached), the model loaded by `POST /api/models/m/load` (timed apart), then the same prompt as a
          streamed completion with max_tokens 1: the first token's time from the send.
Prompt tokens a second = each side's own prompt token count / its TTFT; the ratio is mlxsup's over in-process's,
per round, and the median of the rounds. The first token's text must be the same on both sides (greedy).

The daemon's TTFT is then taken apart from its worker's log (the engine's `[step]` lines at debug level: each step's
end on the monotonic clock the client also reads, its chunk and its time): before the first step (the gateway, the
queue, the submit), the prefill steps themselves, the time between them (the loop, the caches' checkpoints), the step
that feeds the prompt's last token, and after it until the client has the token (the send, the gateway's SSE).
Imports no MLX in this process.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.cache_bench import Daemon, make_prompt
from bench.common import REPO, machine, median, rnd, write_json

STEP = re.compile(r"\[step\] at_ms=([0-9.]+) chunk=(\d+) prefill=(\d+) rows=\d+ decoding=(\d+) "
                  r"predicted_ms=([0-9.]+) ms=([0-9.]+)")


def inproc(model: Path, prompt: str) -> dict:
    """One fresh process: load, then the first token of `prompt` as stream_generate gives it."""
    out = subprocess.run([sys.executable, "-m", "bench.cold_prefill", "--inproc", str(model)], input=prompt,
                         capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _inproc_main(model: str) -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    prompt = sys.stdin.read()
    t0 = time.perf_counter()
    lm, tok = load(model)
    loaded = time.perf_counter()
    ids = tok.encode(prompt)
    for r in stream_generate(lm, tok, ids, max_tokens=1, sampler=make_sampler(0.0)):
        first = time.perf_counter() - loaded
        print(json.dumps({"load_s": round(loaded - t0, 3), "ttft_s": round(first, 4), "prompt_tokens": len(ids),
                          "text": r.text, "token": r.token, "engine_prompt_tps": round(r.prompt_tps, 3)}))
        break


def daemon(model: Path, prompt: str, state: Path) -> dict:
    """A fresh daemon on an empty state folder (no cache holds anything): the load timed, then the prompt's first
    token; its worker's step lines read back."""
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    config = state / "bench.toml"
    config.write_text(f'[server]\nlog_level = "debug"\n\n[models.m]\npath = "{model}"\n')
    d = Daemon(state, config)
    seen: set[int] = {d.proc.pid}
    try:
        t0 = time.perf_counter()
        loaded = d.post("/api/models/m/load")
        load_s = time.perf_counter() - t0
        seen.update(c.pid for c in psutil.Process(d.proc.pid).children(recursive=True))
        sent = time.perf_counter()
        r = d.ttft("m", prompt, 1)
        first = sent + r["ttft_s"]
        if r["cached_tokens"]:
            raise SystemExit(f"the cold prompt found {r['cached_tokens']} tokens cached; see {state}")
    finally:
        d.stop()
    gone = not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in seen)
    log = "\n".join(p.read_text(errors="replace") for p in sorted((state / "logs").glob("worker-m*.log")))
    return {"load_s": round(load_s, 3), "worker_load_s": loaded.get("load_s"), "ttft_s": r["ttft_s"],
            "prompt_tokens": r["prompt_tokens"], "text": r["text"], "processes_gone": gone,
            "breakdown": breakdown(log, sent, first)}


def breakdown(log: str, sent: float, first: float) -> dict:
    """The TTFT's parts from the worker's `[step]` lines between the send and the first token (perf_counter s)."""
    steps = []
    for m in STEP.finditer(log):
        end, ms = float(m.group(1)) / 1e3, float(m.group(6)) / 1e3
        if sent <= end - ms and end <= first:
            steps.append({"start": end - ms, "end": end, "s": ms, "chunk": int(m.group(2)),
                          "prefill": int(m.group(3)), "decoding": int(m.group(4)),
                          "predicted_s": float(m.group(5)) / 1e3})
    prefill = [s for s in steps if s["prefill"]]
    if not prefill:
        return {"steps": len(steps), "error": "no prefill step in the worker's log between the send and the token"}
    last = steps[-1]
    return {
        "before_first_step_s": rnd(steps[0]["start"] - sent),
        "prefill_steps_s": rnd(sum(s["s"] for s in prefill)),
        "between_prefill_steps_s": rnd(prefill[-1]["end"] - prefill[0]["start"] - sum(s["s"] for s in prefill)),
        "after_last_prefill_step_s": rnd(first - prefill[-1]["end"]),
        "last_token_step_s": rnd(sum(s["s"] for s in steps if not s["prefill"])),
        "after_last_step_s": rnd(first - last["end"]),
        "prefill_steps": len(prefill), "chunks": [s["prefill"] for s in prefill],
        "step_s": [rnd(s["s"], 3) for s in prefill],
    }


def chunk_counts(chunks: list[int]) -> str:
    """'4 x 450, 8 x 30': each chunk size and how many steps took it, the most taken first."""
    return ", ".join(f"{size} x {n}" for size, n in Counter(chunks).most_common())


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "# A cold long prompt's prefill: mlxsup against mlx-lm in process", "",
        f"`{result['command']}`", "",
        f"{result['preset']} preset ({result['arch']}), a {s['prompt_tokens']}-token prompt, max_tokens 1, "
        f"{len(result['rounds'])} round(s), sides alternating; each side a fresh process (mlxsup: a fresh daemon with "
        "its default settings, caches on, nothing cached), the load timed apart.", "",
        "| round | in-process TTFT (s) | tok/s | mlxsup TTFT (s) | tok/s | mlxsup / in-process | in-process load (s) "
        "| mlxsup load (s) | same first token |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for i, r in enumerate(result["rounds"]):
        a, b = r["inproc"], r["mlxsup"]
        lines.append(f"| {i} | {a['ttft_s']:.3f} | {a['tps']:.2f} | {b['ttft_s']:.3f} | {b['tps']:.2f} | "
                     f"{r['ratio']:.3f} | {a['load_s']:.2f} | {b['load_s']:.2f} | {r['same_text']} |")
    met = "met" if s["ratio"] >= result["target"] else "NOT met"
    lines += ["", f"Median ratio {s['ratio']:.3f} (target >= {result['target']}: {met}).", "",
              "mlxsup's TTFT taken apart (its worker's `[step]` lines, seconds):", "",
              "| round | before the first step | prefill steps | between them | the last token's step | "
              "after it | steps (chunks) |", "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for i, r in enumerate(result["rounds"]):
        b = r["mlxsup"]["breakdown"]
        if "error" in b:
            lines.append(f"| {i} | {b['error']} | | | | | |")
            continue
        lines.append(f"| {i} | {b['before_first_step_s']} | {b['prefill_steps_s']} | {b['between_prefill_steps_s']} "
                     f"| {b['last_token_step_s']} | {b['after_last_step_s']} | {b['prefill_steps']} "
                     f"({chunk_counts(b['chunks'])}) |")
    m = result["machine"]
    lines += ["", f"Machine: {m['cpu_model']}, {m['logical_cores']} logical cores, {m['os']}, load average at start "
              f"{m['load_avg_at_start']}; mlx {m['versions']['mlx']}, mlx-lm {m['versions']['mlx-lm']}; "
              f"tree {m['git']['commit']} (dirty: {m['git']['dirty']}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cold_prefill", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small", "1b"])
    p.add_argument("--arch", default="llama")
    p.add_argument("--tokens", type=int, default=2048, help="the prompt's length, at least (default 2048)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--target", type=float, default=0.95, help="mlxsup / in-process tokens a second asked for")
    p.add_argument("--out", type=Path, default=None, help="where cold_prefill.json and .md go")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--inproc", default=None, help=argparse.SUPPRESS)  # the in-process side's own process
    args = p.parse_args(argv)
    if args.inproc:
        _inproc_main(args.inproc)
        return 0
    if args.out is None:
        p.error("--out is required")
    command = "python -m bench.cold_prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    m = machine()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="mlxsup-cold-") as tmp:
        work = args.work or Path(tmp)
        model = work / "models" / f"{args.preset}-{args.arch}"
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(model), "--preset", args.preset,
                            "--arch", args.arch], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        for i in range(args.rounds):
            prompt, _ = make_prompt(model, args.tokens)
            prompt = f"Round {i}. {prompt}"  # nothing of an earlier round's prompt in any cache
            sides = {}
            for side in (("inproc", "mlxsup") if i % 2 == 0 else ("mlxsup", "inproc")):
                sides[side] = inproc(model, prompt) if side == "inproc" else daemon(model, prompt, work / f"state-{i}")
                sides[side]["tps"] = round(sides[side]["prompt_tokens"] / sides[side]["ttft_s"], 3)
                print(side, json.dumps({k: v for k, v in sides[side].items() if k != "text"}), flush=True)
            rounds.append({**sides, "ratio": round(sides["mlxsup"]["tps"] / sides["inproc"]["tps"], 4),
                           "same_text": sides["mlxsup"]["text"] == sides["inproc"]["text"]})
    result = {"command": command.strip(), "machine": m, "preset": args.preset, "arch": args.arch,
              "target": args.target, "rounds": rounds,
              "summary": {"ratio": rnd(median([r["ratio"] for r in rounds])),
                          "prompt_tokens": rounds[0]["mlxsup"]["prompt_tokens"],
                          "inproc_prompt_tokens": rounds[0]["inproc"]["prompt_tokens"],
                          "same_text": all(r["same_text"] for r in rounds),
                          "processes_gone": all(r["mlxsup"]["processes_gone"] for r in rounds)}}
    write_json(args.out / "cold_prefill.json", result)
    (args.out / "cold_prefill.md").write_text(markdown(result))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
