"""Where a worker's main thread spends a token: CPU time and wall time per function, against stream_generate's.

    python -m bench.worker_cpu --model DIR --out FILE.json [--streams 1,32] [--rounds 5] [--tokens 256]

On the GPU host the main thread is the bottleneck (the next token is never waited for), so every microsecond of its
work per token is a microsecond of ITL. A real worker subprocess (`python -m worker`, over bare ZeroMQ, as
bench.diagnose's `worker` part drives it) runs with its loop's, engine's and output's functions wrapped: each call's
thread CPU time and wall time summed, and MLX's `async_eval` / `eval` too (the launch of the next token's kernels,
with the GIL released). The same wrapping measures `mlx_lm.stream_generate` in a process of its own. Reported per
token (1 stream) or per step (N streams): which functions cost what, and how much of the step the GIL is free
(inside async_eval), which a second thread could use. Beside the sums, the tail of the loop's steps (`WorkerLoop._step`
wall time: p50, p95, p99, max) and the interpreter's garbage collections in the same period (count and wall time per
generation, from gc.callbacks): are the slow steps that put a worker's p95 ITL above in-process's the collector's?
A function that runs on another thread is summed with that thread's times: `RequestOutput.push` on the text thread.
A wrapped name the measured revision lacks is skipped.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import percentile

# (module, class or None, function): what the worker's wrapper times; keys are "Class.function"
WRAPPED = [
    ("worker.loop", "WorkerLoop", "_step"), ("worker.loop", "WorkerLoop", "_read_inbox"),
    ("worker.loop", "WorkerLoop", "_maybe_heartbeat"), ("worker.loop", "WorkerLoop", "_handle_shutdown"),
    ("worker.loop", "WorkerLoop", "send"), ("protocol.codec", None, "encode"),
    ("worker.channel", "ZmqChannel", "send"), ("worker.channel", "ZmqChannel", "wait"),
    ("worker.mlx_engine.engine", "Engine", "step"), ("worker.mlx_engine.engine", "Engine", "plan_step"),
    ("worker.mlx_engine.solo", "Solo", "_step"), ("worker.mlx_engine.solo", "Solo", "_feed"),
    ("worker.mlx_engine.solo", "Solo", "_out"),
    ("worker.mlx_engine.solo", "Solo", "_build"),
    ("worker.request_output", "RequestOutput", "push"),
    ("worker.request_output", "RequestOutput", "take"), ("mlx_lm.generate", "BatchGenerator", "next"),
    ("worker.mlx_engine.engine", "Engine", "_store"), ("worker.mlx_engine.engine", "Engine", "_hand_off"),
]

_ACC: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
TAILS = ("WorkerLoop._step",)  # the wall time of each of their calls is kept, for percentiles
_WALLS: dict[str, list[float]] = collections.defaultdict(list)
_GC: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # generation -> [collections, wall s]


def _timed(fn: Any, key: str) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            e = _ACC[key]
            e[0] += time.thread_time() - c0
            wall = time.perf_counter() - t0
            e[1] += wall
            e[2] += 1
            if key in TAILS:
                _WALLS[key].append(wall)
    return wrapper


def _watch_gc() -> None:
    import gc
    began = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            g = _GC[str(info["generation"])]
            g[0] += 1
            g[1] += time.perf_counter() - began[0]

    gc.callbacks.append(callback)


def _tails() -> dict:
    return {k: {"n": len(v), **{f"p{q}_us": round((percentile(v, q) or 0.0) * 1e6, 1) for q in (50, 95, 99, 100)}}
            for k, v in _WALLS.items() if v}


def _wrap_mlx() -> None:
    import mlx.core as mx
    mx.async_eval = _timed(mx.async_eval, "mx.async_eval")
    mx.eval = _timed(mx.eval, "mx.eval")


def _stats(units: int) -> dict:
    return {k: {"calls": n, "cpu_us": round(c / units * 1e6, 2), "wall_us": round(w / units * 1e6, 2)}
            for k, (c, w, n) in sorted(_ACC.items())}


def worker_child(argv: list[str]) -> None:
    """The worker, its functions wrapped; SIGUSR2 writes the sums since the last to $WORKER_CPU_OUT and resets them."""
    import importlib
    import runpy

    _wrap_mlx()
    _watch_gc()
    for mod, cls, name in WRAPPED:
        m = importlib.import_module(mod)
        owner = getattr(m, cls) if cls else m
        if hasattr(owner, name):  # a name this revision lacks is not measured (the list spans revisions)
            setattr(owner, name, _timed(getattr(owner, name), f"{cls or mod}.{name}"))
    if "protocol.codec" in sys.modules:  # the loop imported encode by name before the wrap: wrap its reference too
        import worker.loop
        worker.loop.encode = sys.modules["protocol.codec"].encode
    start = [time.thread_time(), time.perf_counter()]

    def dump(*_: Any) -> None:
        body = {"main_thread": {"cpu_s": time.thread_time() - start[0], "wall_s": time.perf_counter() - start[1]},
                "sums": {k: list(v) for k, v in _ACC.items()}, "tails": _tails(),
                "gc": {g: {"collections": n, "wall_ms": round(w * 1e3, 2)} for g, (n, w) in sorted(_GC.items())}}
        Path(os.environ["WORKER_CPU_OUT"]).write_text(json.dumps(body))
        _ACC.clear()
        _WALLS.clear()
        _GC.clear()
        start[:] = [time.thread_time(), time.perf_counter()]

    signal.signal(signal.SIGUSR2, dump)
    sys.argv = ["worker", *argv]
    runpy.run_module("worker", run_name="__main__")


def stream_child(model_dir: str, tokens: int, rounds: int) -> None:
    """stream_generate, MLX's evals wrapped, one chat prompt a round: the per-token sums as JSON on stdout."""
    from mlx_lm import load, stream_generate

    from bench.prompts import prompts
    _wrap_mlx()
    model, tok = load(model_dir)
    n = 0

    def run(tag: str) -> int:
        ids = tok.apply_chat_template(prompts(tag, 1, 24, 0)[0], add_generation_prompt=True)
        return sum(1 for _ in stream_generate(model, tok, ids, max_tokens=tokens))

    run("warm")
    _ACC.clear()
    c0, t0 = time.thread_time(), time.perf_counter()
    for r in range(rounds):
        n += run(f"e{r}")
    print(json.dumps({"tokens": n, "main_thread": {"cpu_us": round((time.thread_time() - c0) / n * 1e6, 2),
                                                   "wall_us": round((time.perf_counter() - t0) / n * 1e6, 2)},
                      "per_token": _stats(n)}))


def measure(model_dir: str, streams: list[int], tokens: int, rounds: int, out: Path,
            worker_args: list[str] | None = None) -> dict:
    import subprocess
    import tempfile

    from bench.diagnose import REPO, BareWorker
    from bench.prompts import prompts

    res: dict = {"tokens": tokens, "rounds": rounds}
    p = subprocess.run([sys.executable, "-m", "bench.worker_cpu", "stream-child", model_dir, str(tokens),
                        str(rounds)], cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    res["stream_generate"] = json.loads(lines[-1]) if lines else {"error": p.stderr[-1500:]}
    tmp = Path(tempfile.mkdtemp(prefix="workercpu-"))
    dump = tmp / "sums.json"
    w = BareWorker(model_dir, tmp / "worker.log", ["--log-level", "INFO", *[a.format(tmp=tmp) for a in worker_args or []]],
                   env={**os.environ, "WORKER_CPU_OUT": str(dump)},
                   main=["-m", "bench.worker_cpu", "worker-child"])
    try:
        w.ready()
        for n in streams:
            w.burst(prompts(f"w{n}", n, 24, 0), tokens)  # warm: this batch's shapes
            w.proc.send_signal(signal.SIGUSR2)
            _wait_for(dump)
            dump.unlink()
            steps = 0
            for r in range(rounds):
                times = w.burst(prompts(f"r{n}-{r}", n, 24, 0), tokens)
                steps += percentile([len(v) - 1 for v in times.values()], 50)
            w.proc.send_signal(signal.SIGUSR2)
            body = json.loads(_wait_for(dump))
            dump.unlink()
            units = max(1, int(steps))  # tokens of one stream: the steps (a step emits one token for each stream)
            mt = body["main_thread"]
            _ACC.clear()
            _ACC.update({k: v for k, v in body["sums"].items()})
            res[f"worker_{n}"] = {"steps": units, "main_thread": {"cpu_us": round(mt["cpu_s"] / units * 1e6, 2),
                                                                  "wall_us": round(mt["wall_s"] / units * 1e6, 2)},
                                  "per_step": _stats(units), "step_tails": body["tails"], "gc": body["gc"]}
    finally:
        w.stop()
    out.write_text(json.dumps(res, indent=1))
    return res


def _wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text()):
            return text
        time.sleep(0.02)
    raise TimeoutError(f"{path} was not written")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker-child":
        worker_child(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "stream-child":
        stream_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.worker_cpu")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--caches", action="store_true",
                    help="the worker with the daemon's default prompt caches (hot 1 GiB, an SSD cache in a temp folder)")
    args = ap.parse_args()
    extra = ["--hot-cache-bytes", str(2**30), "--ssd-cache-root", "{tmp}/ssd"] if args.caches else []
    res = measure(args.model, [int(x) for x in args.streams.split(",")], args.tokens, args.rounds, args.out, extra)
    for k, v in res.items():
        if isinstance(v, dict) and "main_thread" in v:
            top = sorted(((s["cpu_us"], s["wall_us"], name) for name, s in (v.get("per_step") or v.get("per_token")).items()),
                         reverse=True)[:12]
            print(f"[worker_cpu] {k}: main thread per unit {v['main_thread']}", file=sys.stderr)
            for c, wall, name in top:
                print(f"[worker_cpu]   {name:32s} cpu {c:9.2f} us  wall {wall:9.2f} us", file=sys.stderr)
            if "step_tails" in v:
                print(f"[worker_cpu]   steps {v['step_tails']}  gc {v['gc']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
