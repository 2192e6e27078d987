"""MLX CUDA's cache-thrashing abort, and the worker's guard against it (worker/__main__.py MLX_ENV).

    python -m bench.cuda_thrash [--shapes 600]

MLX CUDA keeps per-shape caches (CUDA graphs: 400, cuDNN attention graphs: 256, ...) and, unless
MLX_ENABLE_CACHE_THRASHING_CHECK=0, raises "Cache thrashing is happening" from whatever op meets a cache's miss
number 2 x its capacity over the process's life. A server meets new shapes for as long as it runs: each prefill
chunk of a long prompt at a new length is a new cuDNN attention graph. Two child processes run `--shapes`
causal attentions through mx.fast (bf16, 8 heads of 128, a new length each): one with MLX's default, one with the
worker's environment. Prints one JSON line per child: how many ran, and the error that stopped it, if any.
Needs MLX on CUDA (on another device there is no such cache, and both children run every shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import REPO

CHILD = """
import json, sys
import mlx.core as mx
n, done, error = int(sys.argv[1]), 0, None
try:
    for i in range(n):
        L = 256 + 8 * i
        q = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
        mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=128 ** -0.5, mask="causal"))
        done += 1
except RuntimeError as exc:
    error = str(exc)
print(json.dumps({"device": str(mx.default_device()), "ran": done, "error": error}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cuda_thrash")
    ap.add_argument("--shapes", type=int, default=600)
    args = ap.parse_args()
    from worker.__main__ import MLX_ENV

    base = {k: v for k, v in os.environ.items() if k not in MLX_ENV}
    for name, env in (("mlx_default", base), ("worker_env", {**base, **MLX_ENV})):
        p = subprocess.run([sys.executable, "-c", CHILD, str(args.shapes)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=900)
        last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
        print(json.dumps({"env": name, "exit": p.returncode, **json.loads(last),
                          "stderr_tail": p.stderr[-300:] if p.returncode else ""}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
