"""Issue 16's bench: one model served by a 2-rank worker group next to the same model on one device.

    python -m bench.group_bench --backend nccl --preset 1b --out DIR       # the 2-GPU host (bench/gpu_run.sh group)
    python -m bench.group_bench --backend ring --preset tiny --out DIR     # its logic on this CPU machine

One mlxsup daemon serves two models from the same weights: `single` (one worker, one device) and
`group` (a tensor- or pipeline-sharded group of --ranks ranks; on NCCL each rank sees one GPU of
its own). Each is loaded alone (the other evicted), checked for greedy agreement on one prompt,
warmed up, then measured at every --concurrency: streaming chat requests of --tokens tokens each
(the model's EOS unreachable, bench/model.py), --rounds rounds, aggregate tokens per second.
results.json and results.md go to --out, with the group's ranks, pids and memory from status and
each GPU's memory in use while the group is loaded. Every process is stopped and proven gone.
No new work starts after --deadline seconds; what was measured is written anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx

from bench import client as cl
from bench.common import machine, median, rnd, write_json
from bench.model import make_never_eos_view, make_source_model
from bench.prompts import prompts
from bench.run import http_records, summarize
from bench.servers import Mlxsup

SIDES = ("single", "group")
PARITY_PROMPT = [{"role": "user", "content": "Count the waves on the shore, one by one."}]


def log(t0: float, msg: str) -> None:
    print(f"[group-bench {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def gpu_memory() -> list[str] | None:
    """Each GPU's memory in use (nvidia-smi), or None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines() if out.returncode == 0 else None


def write_config(path: Path, model_dir: Path, args: argparse.Namespace) -> None:
    group = f'ranks = {args.ranks}, backend = "{args.backend}", shard = "{args.shard}"'
    path.write_text(f"""[server]
spare_workers = 0
max_resumes = 0
load_timeout_s = 150

[models.single]
path = "{model_dir}"

[models.group]
path = "{model_dir}"
group = {{ {group} }}
""")


async def measure(d: Mlxsup, http: httpx.AsyncClient, side: str, args: argparse.Namespace, t0: float,
                  deadline: float) -> dict:
    """Load `side`, check it, warm it up, run every concurrency; its evict report at the end."""
    res: dict = {"runs": []}
    t = time.monotonic()
    await d.load(http, side, timeout=180)
    res["load_s"] = rnd(time.monotonic() - t, 3)
    status = await d.model(http, side)
    res["status"] = {k: status.get(k) for k in ("pid", "memory_bytes", "ranks")}
    if side == "group":
        res["gpu_memory_loaded"] = gpu_memory()
    log(t0, f"{side}: loaded in {res['load_s']}s {res['status']}")
    parity = await http.post(d.url + "/v1/chat/completions", timeout=120, json={
        "model": side, "messages": PARITY_PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
    res["greedy_text"] = parity.json()["choices"][0]["message"]["content"] if parity.status_code == 200 \
        else f"HTTP {parity.status_code}: {parity.text[:300]}"
    top = max(args.concurrency)
    await cl.run_concurrent(d.chat_url, [cl.chat_body(side, m, 16, {"ignore_eos": True})
                                         for m in prompts("warm", top, 24, 0)], 120)
    for c in args.concurrency:
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                res.setdefault("skipped", []).append({"c": c, "round": r})
                continue
            bodies = [cl.chat_body(side, m, args.tokens, {"ignore_eos": True}) for m in prompts(f"r{r}c{c}", c, 24, 0)]
            s = summarize(http_records(await cl.run_concurrent(d.chat_url, bodies, 120)), args.tokens)
            s.pop("ttft", None)
            s.pop("itl", None)
            s.update(c=c, round=r)
            res["runs"].append(s)
            log(t0, f"{side} c={c} r={r}: {rnd(s.get('tok_s'), 1)} tok/s exact={s.get('exact')} "
                    f"errors={s['n_errors']}")
    res["peak_batch_size"] = (await d.model(http, side)).get("peak_batch_size")
    res["evict"] = await d.evict(http, side)
    return res


def table(results: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for c in args.concurrency:
        row: dict = {"c": c}
        for side in SIDES:
            runs = [r for r in results.get(side, {}).get("runs", []) if r["c"] == c and r.get("tok_s")]
            row[side] = rnd(median([r["tok_s"] for r in runs]), 1) if runs else None
            row[f"{side}_itl_p50_ms"] = rnd(median([r["itl_p50_s"] * 1000 for r in runs if r.get("itl_p50_s")]), 2) \
                if runs else None
        row["group_vs_single"] = rnd(row["group"] / row["single"], 3) if row["group"] and row["single"] else None
        rows.append(row)
    return rows


def render(results: dict, args: argparse.Namespace) -> str:
    lines = [f"# Worker group bench: {args.ranks} ranks ({args.backend}, {args.shard}) vs one device",
             "", f"Model: {args.preset} preset, {args.tokens} tokens per request, {args.rounds} rounds (median); "
             "aggregate tokens/s over each run.", "",
             "| concurrency | single tok/s | group tok/s | group/single | single ITL p50 ms | group ITL p50 ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in results.get("table", []):
        lines.append(f"| {row['c']} | {row['single']} | {row['group']} | {row['group_vs_single']} | "
                     f"{row['single_itl_p50_ms']} | {row['group_itl_p50_ms']} |")
    g = results.get("group", {})
    lines += ["", f"Group ranks: {g.get('status', {}).get('ranks')}",
              f"GPU memory with the group loaded: {g.get('gpu_memory_loaded')}",
              f"Greedy text equal on both sides: {results.get('greedy_equal')}",
              f"Every process gone at the end: {results.get('cleanup', {}).get('all_gone')}"]
    for side in SIDES:
        if "error" in results.get(side, {}):
            lines.append(f"{side} failed: {results[side]['error']}")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    results: dict = {"meta": {"args": vars(args) | {"out": str(args.out), "work": str(args.work)},
                              "machine": machine(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    src = make_source_model(args.work / "source" / args.preset, args.preset, 0)
    model_dir = args.work / "models" / f"bench-{args.preset}"
    results["meta"]["model"] = make_never_eos_view(src, model_dir)
    log(t0, f"model ready: {model_dir}")
    cfg = args.work / "group-bench.toml"
    write_config(cfg, model_dir, args)
    env = {"NCCL_NVLS_ENABLE": "0"} if args.backend == "nccl" else None  # never NVLink multicast (the host's rule)
    d = Mlxsup(args.work / "no-models", args.work / "state-group", env=env, args=["--config", str(cfg)])
    (args.work / "no-models").mkdir(parents=True, exist_ok=True)
    http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False)
    try:
        await d.start()
        for side in SIDES:
            try:
                results[side] = await measure(d, http, side, args, t0, deadline)
            except Exception as exc:
                log(t0, f"{side} failed: {exc!r}")
                results[side] = {**results.get(side, {}), "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
                try:
                    results[side]["model_status"] = await d.model(http, side)
                except Exception:
                    pass
            d.track()
            results["table"] = table(results, args)
            write_json(args.out / "results.json", results)
    finally:
        proof = await d.stop()
        await http.aclose()
        results["cleanup"] = {**proof, "all_gone": all(v == "gone" for v in proof["pids"].values())}
    texts = [results.get(s, {}).get("greedy_text") for s in SIDES]
    results["greedy_equal"] = texts[0] == texts[1] if all(texts) else None
    results["table"] = table(results, args)
    results["meta"]["elapsed_s"] = rnd(time.monotonic() - t0, 1)
    write_json(args.out / "results.json", results)
    (args.out / "results.md").write_text(render(results, args))
    log(t0, "table: " + json.dumps(results["table"]))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.group_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "ring", "jaccl", "mpi"])
    ap.add_argument("--shard", default="tensor", choices=["tensor", "pipeline"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds; no new run starts after it")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxsup-group-bench"))
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(main_async(args))
    ok = all("error" not in results.get(s, {}) for s in SIDES) and results["cleanup"]["all_gone"]
    print((args.out / "results.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
