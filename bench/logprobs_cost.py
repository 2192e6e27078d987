"""The worker's per-token cost of a logprobs entry with top alternatives (worker/mlx_engine/guided.py), on a real
vocabulary's size: what a request with `top_logprobs` pays for every token of every row, outside the model.

    python -m bench.logprobs_cost [--vocab 151936] [--top 20] [--n 50]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from worker.mlx_engine.guided import logprob_entries


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.logprobs_cost")
    p.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    p.add_argument("--top", type=int, default=20)  # the OpenAI API's most
    p.add_argument("--n", type=int, default=50)
    args = p.parse_args()
    x = mx.random.normal((args.vocab,), key=mx.random.key(0))
    logprobs = x - mx.logsumexp(x)
    mx.eval(logprobs)
    entry = logprob_entries(str, args.top)
    entry(0, logprobs)
    t0 = time.perf_counter()
    for i in range(args.n):
        entry(i, logprobs)
    print(f"vocab {args.vocab}, top {args.top}: {(time.perf_counter() - t0) / args.n * 1e3:.3f} ms an entry "
          f"on {mx.default_device()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
