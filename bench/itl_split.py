"""Issue 30: where the single stream's extra time per token comes from, four sides in the same interleaved rounds.

    python -m bench.itl_split --model DIR --out DIR [--rounds 8] [--tokens 256] [--server-cpus 0-3] [--apart-cpus 4-7]

- `inproc`: mlx-lm's stream_generate in a process of its own (bench/inproc.py), on the server CPUs;
- `daemon`: `mlxsup serve` and its worker on the server CPUs, one streaming chat completion over HTTP from this
  harness (pinned to the CPUs left over), as the throughput section runs it;
- `apart`: the same, but the daemon's threads on other CPUs (`--apart-cpus`) and only its worker's on the server
  CPUs: what sharing the CPUs with the daemon costs the worker;
- `nospare`: `daemon` with `spare_workers = 0` (no idle spare process beside the worker);
- `bare`: a worker alone over bare ZeroMQ on the server CPUs (no daemon, no HTTP: bench.diagnose's W_plain);
- `bare_caches`: the same with the daemon's default prompt caches (hot 1 GiB, an SSD cache).

Each round runs every side once, one at a time, the order rotated. Per side: ITL p50 as the client saw it (the gap
between events, ms), the worker's own per-token split (its `[perf] solo` log line: feed, read, outside), and the
CPU time each process of the side spent per token (psutil, across the whole request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import servers
from bench.client import chat_body, stream_chat
from bench.common import percentile
from bench.diagnose import BareWorker, itl_ms, perf_lines
from bench.prompts import prompts


def perf_count(log: Path) -> int:
    return len(perf_lines(log.read_text(errors="replace"))) if log.exists() else 0


def newest_perf(log: Path, before: int, deadline_s: float = 5.0) -> dict | None:
    """The worker's `[perf] solo` line (bench.diagnose.perf_lines) logged after the first `before`: it follows the
    request's Finished, so it may reach the log after the client saw the end."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        lines = perf_lines(log.read_text(errors="replace")) if log.exists() else []
        if len(lines) > before:
            return lines[-1]
        time.sleep(0.05)
    return None


def cpu_s(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            out[pid] = 0.0
    return out


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (children started later inherit the thread's mask)."""
    for t in psutil.Process(pid).threads():
        try:
            os.sched_setaffinity(t.id, cpus)
        except OSError:
            pass


async def main_async(args: argparse.Namespace) -> dict:
    out_dir = Path(args.out)
    model_dir = Path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="itlsplit-"))
    server_cpus = servers.parse_cpus(args.server_cpus) or set()
    apart_cpus = servers.parse_cpus(args.apart_cpus) or set()
    mine = os.sched_getaffinity(0) - server_cpus - apart_cpus or os.sched_getaffinity(0)
    os.sched_setaffinity(0, mine)  # the harness: off every server's CPUs, where any are left
    model_id = model_dir.name

    servers.SERVER_CPUS = server_cpus
    inproc = servers.InProc(model_dir, tmp / "inproc.log")
    daemon = servers.Mlxsup(model_dir.parent, tmp / "daemon")
    (tmp / "nospare.toml").write_text("[server]\nspare_workers = 0\n")
    nospare = servers.Mlxsup(model_dir.parent, tmp / "nospare", args=["--config", str(tmp / "nospare.toml")])
    servers.SERVER_CPUS = apart_cpus
    apart = servers.Mlxsup(model_dir.parent, tmp / "apart")
    servers.SERVER_CPUS = None
    bare = BareWorker(str(model_dir), tmp / "bare-worker.log", cpus=args.server_cpus)
    bare_caches = BareWorker(str(model_dir), tmp / "bare_caches-worker.log", cpus=args.server_cpus,
                             extra=("--hot-cache-bytes", str(2**30), "--ssd-cache-root", str(tmp / "ssd")))
    results: dict = {"meta": {"server_cpus": args.server_cpus, "apart_cpus": args.apart_cpus,
                              "harness_cpus": ",".join(map(str, sorted(mine))), "tokens": args.tokens,
                              "rounds": args.rounds, "model": str(model_dir)}, "rounds": []}
    try:
        await inproc.start()
        await daemon.start()
        await apart.start()
        await nospare.start()
        import httpx
        async with httpx.AsyncClient(trust_env=False) as c:
            for d in (daemon, apart, nospare):
                await d.load(c, model_id)
                await d.warmed_up(model_id, args.warm_up_s)
            apart_worker = (await apart.model(c, model_id))["pid"]
            daemon_worker = (await daemon.model(c, model_id))["pid"]
            nospare_worker = (await nospare.model(c, model_id))["pid"]
        pin_threads(apart_worker, server_cpus)  # its worker alone back on the server CPUs
        await asyncio.to_thread(bare.ready, 600)
        await asyncio.to_thread(bare_caches.ready, 600)
        pids = {"inproc": [inproc.proc.pid], "daemon": [daemon.proc.pid, daemon_worker],
                "apart": [apart.proc.pid, apart_worker], "nospare": [nospare.proc.pid, nospare_worker],
                "bare": [bare.proc.pid], "bare_caches": [bare_caches.proc.pid]}
        logs = {"daemon": daemon.state_dir / "logs" / f"worker-{model_id}.log",
                "apart": apart.state_dir / "logs" / f"worker-{model_id}.log",
                "nospare": nospare.state_dir / "logs" / f"worker-{model_id}.log", "bare": bare.log,
                "bare_caches": bare_caches.log}

        async def run(side: str, msgs: list, rid: str) -> dict:
            before = cpu_s(pids[side])
            if side == "inproc":
                rec = await inproc.run("stream", [msgs], args.tokens, 300)
                stamps = rec["records"][0]["times"]
            elif side.startswith("bare"):
                stamps, _ = await asyncio.to_thread((bare if side == "bare" else bare_caches).one, msgs, rid,
                                                    args.tokens)
            else:
                server = {"daemon": daemon, "apart": apart, "nospare": nospare}[side]
                rec = await stream_chat(server.chat_url, chat_body(model_id, msgs, args.tokens,
                                                                   {"user": rid}), 300)
                if rec["error"]:
                    raise RuntimeError(f"{side}: {rec['error']}")
                stamps = rec["times"]
            after = cpu_s(pids[side])
            row = {"itl_p50_ms": itl_ms(stamps), "events": len(stamps),
                   "cpu_ms_per_token": {str(p): round((after[p] - before[p]) / args.tokens * 1e3, 3) for p in after}}
            return row

        sides = ["inproc", "daemon", "apart", "nospare", "bare", "bare_caches"]
        for side in sides:  # a warm-up request each
            await run(side, prompts("warm", 1, 24, 0)[0], f"warm-{side}")
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            if r % 2:
                order.reverse()
            row: dict = {"order": order}
            msgs = prompts(f"r{r}", 1, 24, 0)[0]
            for side in order:
                before = perf_count(logs[side]) if side in logs else 0
                row[side] = await run(side, msgs, f"r{r}-{side}")
                if side in logs:  # a daemon names the request itself: the worker's newest line is this one's
                    row[side]["worker"] = await asyncio.to_thread(newest_perf, logs[side], before)
            results["rounds"].append(row)
            print(json.dumps({"round": r, **{s: row[s]["itl_p50_ms"] for s in sides}}), flush=True)
    finally:
        bare.stop()
        bare_caches.stop()
        for s in (inproc, daemon, apart, nospare):
            await s.stop()
    results["summary"] = summarize(results["rounds"], sides)
    (out_dir / "itl_split.json").write_text(json.dumps(results, indent=1))
    (out_dir / "itl_split.md").write_text(report(results))
    return results


def summarize(rounds: list[dict], sides: list[str]) -> dict:
    out = {}
    for side in sides:
        itl = [r[side]["itl_p50_ms"] for r in rounds]
        ratio = [round(r[side]["itl_p50_ms"] / r["inproc"]["itl_p50_ms"], 3) for r in rounds]
        split = [r[side].get("worker") for r in rounds if r[side].get("worker")]
        cpu: dict[str, list[float]] = {}
        for r in rounds:
            for i, v in enumerate(r[side]["cpu_ms_per_token"].values()):
                cpu.setdefault(["server", "worker"][i] if side in ("daemon", "apart", "nospare") else "process", []).append(v)
        out[side] = {"itl_p50_ms_median": round(percentile(itl, 50), 3), "ratio_to_inproc_median": round(percentile(ratio, 50), 3),
                     "ratio_per_round": ratio,
                     "worker_ms_per_token": {k: percentile([s[k] for s in split], 50)
                                             for k in ("feed", "read", "outside", "gc")} if split else None,
                     "cpu_ms_per_token": {k: percentile(v, 50) for k, v in cpu.items()}}
    return out


def report(results: dict) -> str:
    m = results["meta"]
    lines = [f"# Single-stream ITL split ({m['tokens']} tokens, {m['rounds']} interleaved rounds)", "",
             f"server CPUs {m['server_cpus']}, the apart daemon on {m['apart_cpus']}, harness on {m['harness_cpus']}",
             "", "| side | ITL p50 (ms, median) | / inproc (median) | per round | worker feed / read / outside / gc "
             "(ms a token) | CPU ms a token |", "| --- | --- | --- | --- | --- | --- |"]
    for side, s in results["summary"].items():
        w = s["worker_ms_per_token"]
        split = " / ".join(f"{w[k]:.3f}" for k in ("feed", "read", "outside", "gc")) if w else "-"
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in s["cpu_ms_per_token"].items())
        lines.append(f"| {side} | {s['itl_p50_ms_median']} | {s['ratio_to_inproc_median']} | "
                     f"{s['ratio_per_round']} | {split} | {cpu} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.itl_split")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--server-cpus", default="0-3")
    p.add_argument("--apart-cpus", default="4-7")
    p.add_argument("--warm-up-s", type=float, default=300,
                   help="how long to wait for each daemon worker's idle batch-shape warm-up (a GPU's; 0 on a CPU)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = asyncio.run(main_async(args))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
