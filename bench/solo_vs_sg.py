"""Issue 30: stream_generate's generate_step, the worker's Solo driven alone, and the whole Engine (submit/step), on one
model in one process, in interleaved rounds: is a lone request's extra time per token the Solo's or the Engine's?
Each of Solo and Engine also with its next decode graph built ahead on a thread at every step (solo.py's Ahead, its
Pace off), and the Engine as `--solo ahead` runs it (`engine_paced`: built ahead where its Pace measures that faster).
With --pin (Linux), also the Solo built ahead with its main thread pinned to the first allowed CPU and the Ahead
thread to each other allowed CPU in turn, and to all of them (`solo_ahead_pin_M_A`): does the build slow the launch
less on some CPU beside it?

    python -m bench.solo_vs_sg --model DIR [--rounds 10] [--tokens 256] [--compiled] [--pin]
"""

from __future__ import annotations

import argparse
import json
import os
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
from worker.mlx_engine.solo import Ahead, Solo


def pinned(solo: Callable[..., list[float]], main_cpu: int, ahead_cpus: list[int]) -> Callable[..., list[float]]:
    """`solo` built ahead on an Ahead thread pinned to `ahead_cpus`, the calling thread pinned to `main_cpu` while it
    runs (on Linux sched_setaffinity(0) sets the calling thread's CPUs only)."""
    ahead = Ahead()
    ahead.pace = None
    ahead.start(os.sched_setaffinity, 0, set(ahead_cpus))
    ahead.collect()

    def run(ids: list[int], rid: str) -> list[float]:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {main_cpu})
        try:
            return solo(ids, rid, ahead)
        finally:
            os.sched_setaffinity(0, before)
    return run


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.solo_vs_sg")
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--compiled", action="store_true", help="also an Engine whose solo decodes compiled (--solo compiled)")
    p.add_argument("--pin", action="store_true", help="also the Solo built ahead, its two threads pinned (Linux)")
    args = p.parse_args()
    n = args.tokens
    eng = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None, solo="plain")
    ahead_eng = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None, solo="ahead")
    paced_eng = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None, solo="ahead")
    assert ahead_eng.lane.ahead is not None
    ahead_eng.lane.ahead.pace = None  # built ahead at every step
    compiled = Engine(Path(args.model), max_batch_size=32, prefill_step_size=512, cache=None,
                      solo="compiled") if args.compiled else None
    model, tok = load(args.model)

    def sg(ids: list[int], _: str) -> list[float]:
        return [time.perf_counter() for _ in generate_step(mx.array(ids), model, max_tokens=n)]

    ahead = Ahead()
    ahead.pace = None

    def solo(ids: list[int], _: str, ahead: Ahead | None = None) -> list[float]:
        s, ts = Solo(model, 0, ids, 0, None, n, None, None, ahead=ahead), []
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

    variants = {"generate_step": sg, "solo": solo, "solo_ahead": lambda ids, rid: solo(ids, rid, ahead),
                "engine": engine, "engine_ahead": lambda ids, rid: engine(ids, rid, ahead_eng),
                "engine_paced": lambda ids, rid: engine(ids, rid, paced_eng)}
    if compiled is not None:
        variants["engine_compiled"] = lambda ids, rid: engine(ids, rid, compiled)
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        main_cpu, others = cpus[0], cpus[1:]
        for ahead_cpus in [[c] for c in others] + [others]:
            variants[f"solo_ahead_pin_{main_cpu}_{'-'.join(map(str, ahead_cpus))}"] = pinned(solo, main_cpu, ahead_cpus)
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
    pace = paced_eng.lane.ahead.pace if paced_eng.lane.ahead is not None else None
    print(json.dumps({"engine_paced": {"way": pace.way, "changes": pace.changes} if pace is not None else None}))
    print(json.dumps({"itl_p50_ms_median": {k: percentile(v, 50) for k, v in out.items()},
                      "ratio_to_generate_step_median": {
                          k: round(percentile([a / b for a, b in zip(v, out["generate_step"])], 50), 3)
                          for k, v in out.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
