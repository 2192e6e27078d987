"""Where a fresh worker's first Claude Code turn (a 30k-token prompt, scripted reply) spends its time, in one process.
The Engine as the worker builds it (hot and SSD caches), the first recorded request with max_tokens 1; every slow
step printed, and every thread's Python stack dumped every DUMP_S seconds (faulthandler).

    python -m bench.diag_first_turn [preset] [ssd]

On a fresh GPU host the first decode steps wait for MLX CUDA to compile the kernels a batch's first decode needs
(NVRTC), which it keeps on disk for the host's later processes: compare a fresh host's run with a second process's.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path

from bench.agent_replay import Encoder, prepare_model
from bench.agent_traffic import load, submit_of

DUMP_S = 3.0


def main() -> None:
    from worker.mlx_engine import scripted
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.prompt_cache import CacheOptions

    preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    work = Path("/tmp/diag-first-turn")
    work.mkdir(parents=True, exist_ok=True)
    model = prepare_model("qwen3", preset, None, work)
    enc = Encoder(model)
    session = load("claude")
    (work / "script.json").write_text(json.dumps([{"match": m, "reply": r} for m, r in enc.replies(session).items()]))
    ssd = work / "ssd" if len(sys.argv) > 2 and sys.argv[2] == "ssd" else None
    engine = Engine(model, cache=CacheOptions(hot_bytes=16 << 30, ssd_root=ssd), warm="off")
    scripted.install(engine, work / "script.json")
    msg = submit_of(session[0].path, session[0].body)
    msg.max_tokens = 1
    faulthandler.dump_traceback_later(DUMP_S, repeat=True)
    t0 = time.perf_counter()
    engine.submit(msg)
    print("submit_s", round(time.perf_counter() - t0, 3), flush=True)
    while len(engine):
        plan = engine.plan_step()
        ts = time.perf_counter()
        _, fin = engine.step()
        dt = time.perf_counter() - ts
        if dt > 0.2 or fin:
            print("step chunk", plan.chunk, "decoding", plan.decoding, "s", round(dt, 3), "fin" * bool(fin), flush=True)
    faulthandler.cancel_dump_traceback_later()
    print("total_s", round(time.perf_counter() - t0, 2), flush=True)


if __name__ == "__main__":
    main()
