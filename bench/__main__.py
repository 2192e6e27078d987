"""python -m bench [--profile cpu|gpu|smoke] [--out DIR] ...   run every benchmark, write JSON, markdown, PNG
python -m bench render RESULTS.json                          re-render results.md and chart.png
python -m bench merge BASE.json EXTRA.json OUT_DIR [DIAG.json ...]   join two partial runs (+ diagnostics)"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.common import REPO
from bench.params import PROFILES

SECTIONS = ["throughput", "cold_start", "eviction", "overhead", "profile", "cache", "prefill_itl", "resume"]


def _intmap(text: str) -> dict[int, int]:
    """'256' -> same for all; '1:32,8:12,32:6' -> per concurrency."""
    if ":" not in text:
        return {c: int(text) for c in (1, 2, 4, 8, 16, 32, 64, 128)}
    return {int(k): int(v) for k, v in (kv.split(":") for kv in text.split(","))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":  # python -m bench merge BASE.json EXTRA.json OUT_DIR
        import json

        from bench.common import write_json
        from bench.report import render
        from bench.run import merge_results

        merged = merge_results(json.loads(Path(argv[1]).read_text()), json.loads(Path(argv[2]).read_text()))
        for diag in argv[4:]:  # bench.diagnose outputs, shown in a Diagnostics section
            merged.setdefault("diagnostics", {}).update(
                {k: v for k, v in json.loads(Path(diag).read_text()).items() if k not in ("python", "env_pythonpath")})
        write_json(Path(argv[3]) / "results.json", merged)
        for path in render(Path(argv[3]) / "results.json"):
            print(path)
        return 0
    if argv and argv[0] == "render":
        from bench.report import render

        for path in render(Path(argv[1])):
            print(path)
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<profile>)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder: models, state, logs")
    ap.add_argument("--model", type=Path, default=None, help="an existing `mlxsup make-model` folder to use")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--concurrency", default=None, help="e.g. 1,8,32")
    ap.add_argument("--tokens", default=None, help="'256' or '1:32,8:12,32:6'")
    ap.add_argument("--rounds", default=None, help="'5' or '1:3,8:2,32:1'")
    ap.add_argument("--deadline", type=float, default=None, help="seconds; no new work starts after it")
    ap.add_argument("--cache-bench", choices=["run", "include"], default=None,
                    help="run bench/cache_bench.py, or include its committed results (default: the profile's)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="memory bandwidth in GB/s for the decode bound (default: the GPU's datasheet figure)")
    ap.add_argument("--server-cpus", default=None,
                    help="CPUs every side's server runs on: auto (first quarter), '' (unpinned), or e.g. 0-3")
    ap.add_argument("--client-cpus", default=None,
                    help="CPUs the harness (the HTTP clients) runs on: rest (all but the servers'), '' (unpinned), or e.g. 4-15")
    ap.add_argument("--mlxsup-b", default=None, metavar="DIR",
                    help="another checkout's mlxsup as a fifth throughput side, mlxsup_b, in the same rounds (an A/B)")
    ap.add_argument("--mlxsup-b-env", action="append", default=[], metavar="K=V",
                    help="environment for mlxsup_b's daemon and workers only (repeatable), e.g. MLXSUP_CONFIG=FILE")
    ap.add_argument("--mlxsup-env", action="append", default=[], metavar="K=V",
                    help="environment for the throughput section's mlxsup daemon and its workers (repeatable)")
    args = ap.parse_args(argv)

    p = PROFILES[args.profile]
    if args.concurrency:
        p = replace(p, concurrency=[int(x) for x in args.concurrency.split(",")])
    if args.tokens:
        p = replace(p, tokens=_intmap(args.tokens))
    if args.rounds:
        p = replace(p, rounds=_intmap(args.rounds))
    if args.deadline:
        p = replace(p, deadline_s=args.deadline)
    if args.bandwidth_gbs:
        p = replace(p, bandwidth_gbs=args.bandwidth_gbs)
    if args.server_cpus is not None:
        p = replace(p, server_cpus=args.server_cpus)
    if args.client_cpus is not None:
        p = replace(p, client_cpus=args.client_cpus)
    if args.mlxsup_b is not None:
        p = replace(p, mlxsup_b=str(Path(args.mlxsup_b).resolve()))
    if args.mlxsup_b_env:
        p = replace(p, mlxsup_b_env=tuple(args.mlxsup_b_env))
    if args.mlxsup_env:
        p = replace(p, mlxsup_env=tuple(args.mlxsup_env))
    if args.cache_bench:
        p = replace(p, run_cache_bench=args.cache_bench == "run")
    out = args.out or REPO / "bench" / "results" / p.profile
    work = args.work or Path(tempfile.gettempdir()) / f"mlxsup-bench-{p.profile}"
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")

    from bench.report import render
    from bench.run import Bench

    bench = Bench(p, work, out, args.model, sections, "python -m bench " + shlex.join(argv))

    async def go() -> dict:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # unwind through every finally: servers get stopped
            loop.add_signal_handler(sig, task.cancel)
        return await bench.run()

    try:
        asyncio.run(go())
    except asyncio.CancelledError:
        print("interrupted; partial results written", file=sys.stderr)
    for path in render(out / "results.json"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
