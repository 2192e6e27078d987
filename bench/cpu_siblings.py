"""Which CPUs slow a decode loop on CPU 0: hidden hyperthread siblings on a virtual machine.

    python -m bench.cpu_siblings --model DIR --out FILE.json [--tokens 128] [--repeat 2]

A VM may report one thread per core while two of its vCPUs share a physical core of the host. Then a busy process on
one slows a process on the other, and a benchmark's speed depends on where the OS put its other processes (the HTTP
client, the daemon). stream_generate runs pinned to CPU 0, a round at a time; between rounds a spinner (numpy
matmuls, which keep a core's execution units busy) is pinned to each other CPU in turn. A CPU whose spinner makes
CPU 0's ITL markedly longer than with no spinner shares its core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import REPO, percentile

CHILD = r"""
import json, sys, time
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1])
ids = tok.encode("Tell me a story about a lighthouse keeper and the sea.")
def itl(n):
    t = [time.perf_counter() for _ in stream_generate(model, tok, ids, max_tokens=n)]
    g = sorted(b - a for a, b in zip(t, t[1:]))
    return g[len(g) // 2] * 1e3
itl(32)
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(itl(int(line))), flush=True)
"""

SPIN = "import numpy as np\na = np.random.rand(256, 256)\nwhile True:\n    a = np.tanh(a @ a)"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_siblings")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU the decode loop runs on")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child = subprocess.Popen(["taskset", "-c", str(args.cpu), sys.executable, "-c", CHILD, args.model], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdin is not None and child.stdout is not None
    while child.stdout.readline().strip() != "ready":
        if child.poll() is not None:
            raise SystemExit("the decode loop did not start")

    def round_ms() -> float:
        child.stdin.write(f"{args.tokens}\n")
        child.stdin.flush()
        return float(child.stdout.readline())

    res: dict = {"cpu": args.cpu, "tokens": args.tokens, "trials": []}
    try:
        for rep in range(args.repeat):
            for k in [None, *[c for c in cpus if c != args.cpu], None]:
                spinner = None if k is None else subprocess.Popen(
                    ["taskset", "-c", str(k), sys.executable, "-c", SPIN], env=env)
                try:
                    ms = [round_ms() for _ in range(2)]
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait(10)
                res["trials"].append({"repeat": rep, "spinner_cpu": k, "itl_p50_ms": [round(x, 3) for x in ms]})
                print(f"[siblings] spinner on {k}: ITL p50 {ms}", file=sys.stderr, flush=True)
    finally:
        child.stdin.close()
        child.wait(30)
    base = percentile([x for t in res["trials"] if t["spinner_cpu"] is None for x in t["itl_p50_ms"]], 50)
    by_cpu: dict = {}
    for t in res["trials"]:
        if t["spinner_cpu"] is not None:
            by_cpu.setdefault(t["spinner_cpu"], []).extend(t["itl_p50_ms"])
    res["no_spinner_ms"] = base
    res["slowdown_by_spinner_cpu"] = {str(k): round(percentile(v, 50) / base, 3) for k, v in sorted(by_cpu.items())}
    args.out.write_text(json.dumps(res, indent=1))
    print(f"[siblings] no spinner {base:.3f} ms; slowdown by spinner CPU {res['slowdown_by_spinner_cpu']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
