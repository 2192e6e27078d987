"""Issue 47: on a slowed worker, how much of an interrupted prefill is kept, and the time to first token of a request
that is retried or resumed against one that is not.

One daemon, one model, its worker slowed by the `slowed` fault (worker/faults.py: from its 4th step on it runs 1/20 of
the time, stopped and continued by a helper process; its watchdog keeps it from being killed as hung), the SSD cache
on; a first request takes the worker past the fault's first full-speed steps. Each round, on a prompt of its own (nothing cached), in turn:
  whole    the prompt streamed, uninterrupted: its time to first token (TTFT);
  retry    the prompt streamed; at `--interrupt-at` of whole's TTFT the client disconnects (as Codex does after its idle timeout)
           and sends it again at once: the first attempt's prefilled tokens (the worker's `[usage] ... aborted` line),
           the retry's cached tokens (kept) and prefilled tokens, its TTFT from the resend and from the first send;
  killed   the prompt streamed; as long after, its worker is SIGKILLed: the request resumes on a new worker
           (the hot cache died with the old one; the SSD has what was written): its cached tokens and TTFT (the new
           worker's first 3 steps run at full speed: the fault's, a small advantage to this side).
Kept and lost: kept = the next attempt's cached tokens; lost = what the interrupted attempt prefilled less that.

    python -m bench.slow_prefill --out bench/results/cpu/slow_prefill      # ~10 min here (tiny preset)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import machine, median, rnd, write_json
from bench.servers import Mlxsup

ABORTED = re.compile(r"\[usage\] rid=(\S+) prompt=(\d+) cached=(\d+) prefilled=(\d+) aborted")
MODEL = "slowed"


async def stream(http: httpx.AsyncClient, url: str, body: dict, leave_after_s: float | None = None,
                 kill_after_s: float | None = None, kill=None) -> dict:
    """Stream a completion; leave it (disconnect) after `leave_after_s`, or call `kill()` after `kill_after_s`.
    Returns the first token's time, usage, whether it was left, the request id, an error."""
    out: dict = {"first": None, "usage": None, "left": False, "rid": None, "error": None}
    t0 = time.perf_counter()
    timer = asyncio.get_running_loop().call_later(kill_after_s, kill) if kill is not None else None

    async def read() -> None:
        body_ = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", url, json=body_) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                out["rid"] = data.get("id", out["rid"])
                if "error" in data:
                    out["error"] = data["error"]
                    return
                if data.get("usage"):
                    out["usage"] = data["usage"]
                if out["first"] is None and data.get("choices") and data["choices"][0].get("text"):
                    out["first"] = time.perf_counter() - t0

    try:
        await asyncio.wait_for(read(), leave_after_s)
    except TimeoutError:
        out["left"] = True  # the stream is closed: the client is gone
    finally:
        if timer is not None:
            timer.cancel()
    return out


def cached_of(usage: dict | None) -> int | None:
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


async def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    models = work / "models"
    state = work / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    cfg = state / "c.toml"
    cfg.write_text(f'[models.{MODEL}]\npath = "{models / "m"}"\nworker_args = ["--fault", "slowed"]\n\n'
                   f'[cache]\nssd_dir = "{state / "ssd"}"\n')
    server = Mlxsup(work / "empty", state, args=["--config", str(cfg)])
    (work / "empty").mkdir(exist_ok=True)
    await server.start()
    rounds = []
    try:
        async with httpx.AsyncClient(timeout=1800) as http:
            url = server.url + "/v1/completions"
            await server.load(http, MODEL)
            # past the fault's first steps (it slows the worker from its 4th on), so every side runs slowed
            await stream(http, url, {"model": MODEL, "prompt": "warm " * 300, "max_tokens": 8, "temperature": 0})
            for i in range(args.rounds):
                def body(side: str) -> dict:
                    words = " ".join(f"w{(i * 7919 + k * 31 + len(side)) % 5000}" for k in range(args.words))
                    return {"model": MODEL, "prompt": f"{side} {i}: {words}", "max_tokens": 2, "temperature": 0}

                whole = await stream(http, url, body("whole"))
                interrupt_s = args.interrupt_at * (whole["first"] or 0)
                b = body("retry")
                aborted_before = len(ABORTED.findall((state / "daemon.log").read_text(errors="replace")))
                t_first = time.perf_counter()
                first = await stream(http, url, b, leave_after_s=interrupt_s)
                t_resend = time.perf_counter()
                retry = await stream(http, url, b)
                pid = (await server.model(http, MODEL))["pid"]
                killed = await stream(http, url, body("killed"), kill_after_s=interrupt_s,
                                      kill=lambda pid=pid: os.kill(pid, signal.SIGKILL))
                log = (state / "daemon.log").read_text(errors="replace")
                aborted = ABORTED.findall(log)[aborted_before:]  # the first attempt's (its client left before any id)
                prefilled_before = int(aborted[0][3]) if aborted and first["left"] else None
                kept = cached_of(retry["usage"])
                rounds.append({
                    "prompt_tokens": (whole["usage"] or {}).get("prompt_tokens"),
                    "whole_ttft_s": rnd(whole["first"], 2),
                    "interrupt_s": rnd(interrupt_s, 2),
                    "retry_first_attempt_prefilled": prefilled_before,
                    "retry_kept": kept,
                    "retry_lost": None if prefilled_before is None or kept is None else prefilled_before - kept,
                    "retry_ttft_from_resend_s": rnd(retry["first"], 2),
                    "retry_ttft_from_first_send_s": rnd(t_resend - t_first + retry["first"], 2)
                    if retry["first"] is not None else None,
                    "killed_kept": cached_of(killed["usage"]),
                    "killed_ttft_s": rnd(killed["first"], 2),
                    "killed_error": killed["error"],
                })
                print(json.dumps(rounds[-1]), flush=True)
            status = await server.model(http, MODEL)
    finally:
        proof = await server.stop()
    col = {k: [r[k] for r in rounds if r[k] is not None] for k in rounds[0]} if rounds else {}
    return {"machine": machine(), "params": vars(args), "rounds": rounds,
            "median": {k: rnd(median(v), 2) for k, v in col.items() if v and isinstance(v[0], (int, float))},
            "ratios": {"retry_ttft_from_resend_over_whole": rnd(median(col["retry_ttft_from_resend_s"])
                                                                / median(col["whole_ttft_s"]), 3)
                       if col.get("retry_ttft_from_resend_s") and col.get("whole_ttft_s") else None,
                       "killed_ttft_over_whole": rnd(median(col["killed_ttft_s"]) / median(col["whole_ttft_s"]), 3)
                       if col.get("killed_ttft_s") and col.get("whole_ttft_s") else None},
            "daemon": {"crashes": status.get("crashes"), "resumed": status.get("resumed")},
            "processes": proof}


def markdown(res: dict) -> str:
    lines = ["# Issue 47: an interrupted prefill on a slowed worker (1/20 of the time)", "",
             f"`python -m bench.slow_prefill` {res['params']}", "",
             "| prompt | whole TTFT s | retry: 1st attempt prefilled | kept | lost | retry TTFT from resend s | "
             "killed: kept | killed TTFT s |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rounds"]:
        lines.append(f"| {r['prompt_tokens']} | {r['whole_ttft_s']} | {r['retry_first_attempt_prefilled']} | "
                     f"{r['retry_kept']} | {r['retry_lost']} | {r['retry_ttft_from_resend_s']} | {r['killed_kept']} | "
                     f"{r['killed_ttft_s']} |")
    lines += ["", f"Ratios (medians): {res['ratios']}", f"Daemon: {res['daemon']}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/mlxsup-bench-slow-prefill")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--interrupt-at", type=float, default=0.6,
                    help="interrupt (leave, kill) at this part of the round's uninterrupted time to first token")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    models = Path(args.work) / "models"
    if not (models / "m").exists():
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(models / "m"), "--preset",
                        args.preset], check=True)
    res = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", res)
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
