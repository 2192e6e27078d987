"""stream_generate's generate_step, the worker's Solo driven alone, and the whole Engine (submit/step), on one model in
one process, in interleaved rounds: is a lone request's extra time per token the Solo's or the Engine's?

    python -m bench.solo_vs_sg --model DIR [--rounds 10] [--tokens 256] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from bench.common import percentile
from bench.diagnose import itl_ms
from bench.prompts import prompts
from protocol.messages import Submit
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.solo import Solo


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.solo_vs_sg")
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--compiled", action="store_true", help="also an Engine whose solo decodes compiled (--solo compiled)")
    args = p.parse_args()
    n = args.tokens
    eng = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None, solo="plain")
    compiled = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None,
                      solo="compiled") if args.compiled else None
    model, tok = load(args.model)

    def sg(ids: list[int], _: str) -> list[float]:
        return [time.perf_counter() for _ in generate_step(mx.array(ids), model, max_tokens=n)]

    def solo(ids: list[int], _: str) -> list[float]:
        s, ts = Solo(model, 0, ids, 0, None, n, None, None), []
        while True:
            out = s.step(512)
            if out:
                ts.append(time.perf_counter())
                if out[-1].finish_reason is not None:
                    return ts

    def engine(ids: list[int], rid: str, eng: Engine = eng) -> list[float]:
        eng.submit(Submit(rid=rid, max_tokens=n, prompt_ids=ids, temperature=0.0, ignore_eos=True))
        ts = []
        while len(eng):
            chunks, finished = eng.step()
            if chunks or finished:
                ts.append(time.perf_counter())
        return ts

    variants: dict[str, Callable[[list[int], str], list[float]]] = {"generate_step": sg, "solo": solo,
                                                                    "engine": engine}
    if compiled is not None:
        variants["engine_compiled"] = lambda ids, rid: engine(ids, rid, compiled)
    out: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(-1, args.rounds):
        ids = tok.apply_chat_template(prompts(f"e{r}", 1, 24, 0)[0], add_generation_prompt=True)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if r % 2 == 0 else order[::-1]):
            itl = itl_ms(variants[name](ids, f"{name}{r}"))
            if r >= 0:
                out[name].append(itl)
        if r >= 0:
            print(json.dumps({"round": r, **{k: v[-1] for k, v in out.items()}}), flush=True)
    print(json.dumps({"itl_p50_ms_median": {k: percentile(v, 50) for k, v in out.items()},
                      "ratio_to_generate_step_median": {
                          k: round(percentile([a / b for a, b in zip(v, out["generate_step"])], 50), 3)
                          for k, v in out.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
