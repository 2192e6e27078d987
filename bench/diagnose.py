"""Targeted measurements behind the missed targets (not part of the standard run).

    python -m bench.diagnose --model DIR --out FILE.json [--parts imports,exit,arrival]

imports  python -X importtime of what the worker imports: where a cold start's seconds go before load
exit     a process that loaded the model and generated: time from the end of its work to being reaped,
         for a plain return, after gc + mx.clear_cache, and with os._exit(0) (eviction's tail)
engine   one process, batch 1, ITL of: S mlx_lm.stream_generate; A mlx_lm.load + BatchGenerator loop (the bench's inproc_batch);
         B the product's worker.mlx_engine.engine.Engine (its own loader) driven by submit/step, no sockets;
         E = B with its solo decode steps plain, M = compiled (worker/mlx_engine/decode_graph.py), whatever B's
         `--solo auto` picks on this machine;
         C B's model under a plain BatchGenerator loop; D = B plus, per step, what WorkerLoop adds
         (msgpack-encode the Tokens message, zmq send, zmq poll(0)): which of these makes the worker slow
store    the prompt caches' share of the generation loop: Engine with a hot and an SSD cache, waves of
         `n` requests with distinct ~4-block prompts finishing together; the seconds inside PromptCaches.store and
         .hand_off (where it exists) against the seconds inside Engine.step
chains   the same, without a model: 32 finished sequences of 1b-preset K/V (16 layers, 8 KV heads, head dim 64,
         bfloat16, 320 tokens) stored in one step; the main thread's seconds in store, and in hand_off at the next
         step (a stand-in step of MLX work between), per round
worker   a real worker subprocess (`python -m worker`) driven over ZeroMQ by a bare ROUTER socket, no supervisor
         and no HTTP: batch-1 ITL and tok/s as its Tokens messages arrive, for worker flag sets (plain, prompt
         caches on, solo plain or compiled, solo off, caches on with solo off); set beside `engine`'s in-process figures it splits the gap between mlxsup and
         stream_generate into the worker process's share and the supervisor/HTTP share
arrival  in-process BatchGenerator at 32 sequences: all inserted at once (the bench's ceiling) vs
         inserted a few per step, as requests reach mlxsup's worker over ZeroMQ, and all at once with prompt
         lengths new to the process (its groups' batch sizes known); the steps' times for
         (generation batch, prefill batch) sizes seen for the first time vs again (MLX kernel compile)
ramp     32 greedy requests at once to a worker over bare ZeroMQ (as the daemon starts it: warm-up, caches on or
         off) against bench.inproc's BatchGenerator, alternating rounds: TTFT p50 and tok/s, the worker's ramp steps
long     a long prompt's TTFT in one process: the product's Engine (submit/step, its step cost model sizing the
         prefill chunks; every step's chunk and seconds) against mlx_lm.stream_generate, each after two warm-up
         prompts of the same length (other tokens)
cudnn    MLX CUDA's attention through cuDNN or not (one subprocess each: MLX_CUDA_USE_CUDNN_SDPA=1, =0, and =1 with
         the worker's route, worker/mlx_engine/attention.py, MLXSUP_DIAG_ATTENTION=routed): cuDNN builds a graph for
         every new (q, k, mask) shape and stride. A batch-1 prefill of prompt lengths seen for the first time vs
         again, a long prompt's prefill speed (2048-token chunks, warm), and `arrival` under each setting
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, percentile

WORKER_IMPORTS = "import mlx.core; import zmq, psutil, msgpack; import mlx_lm; from mlx_lm.generate import BatchGenerator"


def part_imports() -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", WORKER_IMPORTS + "; import sys; "
                        "print(sorted(m for m in ('torch', 'jax', 'tensorflow', 'torchvision') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    wall = time.perf_counter() - t
    rows = []
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)) / 1e6, len(m.group(3)) - 1, m.group(4)))
    top = sorted([r for r in rows if r[1] <= 4], reverse=True)[:20]
    return {"wall_s": round(wall, 3), "heavy_modules_loaded": p.stdout.strip(),
            "top_cumulative_s": [[name, depth, round(s, 3)] for s, depth, name in top]}


EXIT_CHILD = r"""
import sys, time, os, gc, json
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator
model, tok = load(sys.argv[1])
g = BatchGenerator(model)
list(stream_generate(model, tok, tok.encode("hello there"), max_tokens=4))
variant = sys.argv[2]
if variant == "settled":
    g.close(); del g, model; gc.collect(); mx.clear_cache()
print(json.dumps({"t_done": time.monotonic()}), flush=True)
if variant == "os_exit":
    os._exit(0)
"""


def part_exit(model: str, rounds: int) -> dict:
    out: dict = {}
    for variant in ("normal", "settled", "os_exit"):
        vals = []
        for _ in range(rounds):
            proc = subprocess.Popen([sys.executable, "-c", EXIT_CHILD, model, variant], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=REPO)
            line = proc.stdout.readline()
            proc.wait(300)
            t_reaped = time.monotonic()
            try:
                vals.append(t_reaped - json.loads(line)["t_done"])
            except (ValueError, KeyError):
                vals.append(None)
        out[variant] = [None if v is None else round(v, 3) for v in vals]
    return out


def part_arrival(model_dir: str, n: int, tokens: int, rounds: int) -> dict:
    import random

    import mlx.core as mx  # noqa: F401
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from bench.prompts import prompts

    model, tok = load(model_dir)
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8, prefill_step_size=512)
    seen: set = set()
    step_first, step_again = [], []

    def run(mode: str, tag: str, seed: int, words: int = 24) -> dict:
        rng = random.Random(seed)
        toks = [tok.apply_chat_template(m, add_generation_prompt=True) for m in prompts(tag, n, words, 0)]
        pending = list(toks)
        t0 = time.perf_counter()
        start, times, uids = {}, {}, []

        def insert(k: int) -> None:
            batch, pending[:] = pending[:k], pending[k:]
            if batch:
                for u in gen.insert(batch, max_tokens=[tokens] * len(batch)):
                    uids.append(u)
                    start[u] = time.perf_counter() - t0
                    times[u] = []

        insert(rng.randint(1, 4) if mode == "trickle" else n)
        left = n
        while left:
            key = (len(gen._generation_batch), len(gen._prompt_batch), len(gen._unprocessed_sequences) > 0)
            ts = time.perf_counter()
            _, rs = gen.next()
            dt = time.perf_counter() - ts
            (step_again if key in seen else step_first).append(dt)
            seen.add(key)
            t = time.perf_counter() - t0
            for r in rs:
                times[r.uid].append(t)
                if r.finish_reason is not None:
                    left -= 1
            if pending:
                insert(rng.randint(1, 4))
        end = max(v[-1] for v in times.values())
        ttft = [times[u][0] - start[u] for u in uids]
        return {"mode": mode, "tok_s": round(n * tokens / end, 1), "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1),
                "ttft_max_ms": round(max(ttft) * 1e3, 1), "last_insert_ms": round(max(start.values()) * 1e3, 1)}

    run("all", "warm", 0)
    out = []
    for r in range(rounds):
        for mode in ("all", "trickle"):
            out.append(run(mode, f"a{r}{mode}", r))
        out.append(run("all_new_lengths", f"a{r}n", r, 40 + 7 * r))  # all at once, prompt lengths new to the process
    q = lambda xs, k: None if not xs else round(percentile(xs, k) * 1e3, 2)  # noqa: E731
    return {"n": n, "tokens": tokens, "runs": out,
            "step_ms_first_seen_shape": {"count": len(step_first), "p50": q(step_first, 50), "p95": q(step_first, 95)},
            "step_ms_seen_before": {"count": len(step_again), "p50": q(step_again, 50), "p95": q(step_again, 95)}}


def prefill_shapes(model_dir: str) -> dict:
    """Batch-1 prefill step times (ms) for lengths new to this process vs seen; a warm 4096-token prefill's tok/s."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_dir)

    def prefill(n: int, chunk: int = 2048) -> float:
        cache = make_prompt_cache(model)
        ids = mx.array([[(7 * i) % 1000 + 10 for i in range(n)]])
        t0 = time.perf_counter()
        for a in range(0, n, chunk):
            mx.eval(model(ids[:, a:a + chunk], cache=cache))
        return time.perf_counter() - t0

    prefill(16)  # the first kernels, whatever the shape
    lengths = list(range(40, 56))
    first = [prefill(n) for n in lengths]
    again = [prefill(n) for n in lengths]
    prefill(4096)
    long_s = [prefill(4096) for _ in range(3)]
    q = lambda xs: round(percentile(xs, 50) * 1e3, 2)  # noqa: E731
    return {"prefill_ms_new_length_p50": q(first), "prefill_ms_new_length_max": round(max(first) * 1e3, 2),
            "prefill_ms_seen_length_p50": q(again), "prefill_4096_tok_s": round(4096 / percentile(long_s, 50), 1)}


def part_long(model_dir: str, n: int = 4194, rounds: int = 2) -> dict:
    import mlx.core as mx  # noqa: F401
    from mlx_lm import stream_generate

    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine

    engine = Engine(Path(model_dir), warm="off")
    vocab = engine.vocab_size - 10
    prompt = lambda seed: [(i * 7919 + seed * 104729) % vocab + 5 for i in range(n)]  # noqa: E731

    def engine_ttft(seed: int) -> dict:
        steps = []
        t0 = time.perf_counter()
        engine.submit(Submit(rid=f"r{seed}", max_tokens=4, prompt_ids=prompt(seed), temperature=0.0, ignore_eos=True))
        first = None
        while len(engine):
            plan = engine.plan_step()
            ts = time.perf_counter()
            chunks, finished = engine.step()
            steps.append((plan.prefill_tokens, round((time.perf_counter() - ts) * 1e3, 1)))
            if first is None and (chunks or finished):
                first = time.perf_counter() - t0
        return {"ttft_ms": round((first or 0) * 1e3, 1), "steps_tokens_ms": steps}

    def stream_ttft(seed: int) -> float:
        t0 = time.perf_counter()
        for _ in stream_generate(engine.model, engine.tokenizer, prompt(seed), max_tokens=1):
            return round((time.perf_counter() - t0) * 1e3, 1)
        return 0.0

    warm = [engine_ttft(s) for s in (1, 2)] + [stream_ttft(s) for s in (3, 4)]
    return {"tokens": n, "warm_up": warm, "engine": [engine_ttft(10 + r) for r in range(rounds)],
            "stream_generate_ttft_ms": [stream_ttft(20 + r) for r in range(rounds)]}


def part_cudnn(model_dir: str, rounds: int) -> dict:
    out = {}
    for flag, route in (("1", "fast"), ("1", "routed"), ("0", "fast")):
        with tempfile.TemporaryDirectory() as d:
            argv = [sys.executable, "-m", "bench.diagnose", "--model", model_dir, "--out", f"{d}/r.json",
                    "--parts", "prefill_shapes,arrival", "--rounds", str(rounds)]
            p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": flag, "MLXSUP_DIAG_ATTENTION": route})
            res = json.loads(Path(f"{d}/r.json").read_text()) if Path(f"{d}/r.json").exists() else {}
        out[f"cudnn={flag},attention={route}"] = {k: res.get(k) for k in ("prefill_shapes", "arrival")} | (
            {"stderr_tail": p.stderr[-800:]} if p.returncode else {})
    return out


def itl_ms(stamps: list[float]) -> float:
    """The median gap between consecutive arrival stamps, in ms."""
    return round(percentile([b - a for a, b in zip(stamps, stamps[1:])], 50) * 1e3, 3)


def stream_times(model, tok, msgs: list[dict], tokens: int) -> list[float]:
    """mlx_lm.stream_generate on one chat prompt: the time each token arrived."""
    from mlx_lm import stream_generate

    return [time.perf_counter() for _ in stream_generate(model, tok, tok.apply_chat_template(
        msgs, add_generation_prompt=True), max_tokens=tokens)]


def stream_itls(model_dir: str, tokens: int, rounds: int) -> list[float]:
    """stream_generate's ITL p50 (ms) per round in this process, after one warm-up round."""
    from mlx_lm import load

    from bench.prompts import prompts
    model, tok = load(model_dir)
    stream_times(model, tok, prompts("ew", 1, 24, 0)[0], tokens)
    return [itl_ms(stream_times(model, tok, prompts(f"e{r}", 1, 24, 0)[0], tokens)) for r in range(rounds)]


STREAM_CHILD = "import json, sys; from bench.diagnose import stream_itls; " \
               "print(json.dumps(stream_itls(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))"


def pyspy_prefix(name: str) -> list[str]:
    """With DIAG_PYSPY=DIR: py-spy recording the process it starts into DIR/NAME.txt (raw collapsed stacks, wall
    time: --idle, not pausing it: --nonblocking), else nothing."""
    from bench.profile import find_pyspy

    out, exe = os.environ.get("DIAG_PYSPY"), find_pyspy()
    if not out or exe is None:
        return []
    Path(out).mkdir(parents=True, exist_ok=True)
    return [exe, "record", "--rate", "500", "--format", "raw", "--idle", "--nonblocking", "--output",
            str(Path(out) / f"{name}.txt"), "--"]


def stream_subprocess(model_dir: str, tokens: int, rounds: int, cpus: str | None = None) -> dict:
    """stream_itls in a process of its own (pinned to `cpus` with taskset, if given)."""
    argv = ([] if cpus is None else ["taskset", "-c", cpus]) + pyspy_prefix("stream_generate") + [
        sys.executable, "-c", STREAM_CHILD, model_dir, str(tokens), str(rounds)]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stdout.strip().splitlines() if line.startswith("[")]
    itls = json.loads(lines[-1]) if p.returncode == 0 and lines else []
    return {"cpus": cpus, "itl_p50_ms_per_round": itls, "itl_p50_ms_median": percentile(itls, 50) if itls else None,
            "stderr_tail": p.stderr[-500:] if p.returncode else ""}


def part_engine(model_dir: str, tokens: int, rounds: int) -> dict:
    import logging

    import mlx.core as mx  # noqa: F401
    import zmq
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from bench.prompts import prompts
    from protocol.codec import encode
    from protocol.messages import Submit, Tokens
    from worker.mlx_engine.engine import Engine

    class Keep(logging.Handler):
        lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    keep = Keep()
    engine_log = logging.getLogger("worker.mlx_engine.engine")
    engine_log.setLevel(logging.DEBUG)
    engine_log.addHandler(keep)
    model_a, tok_a = load(model_dir)
    eng = Engine(Path(model_dir), max_batch_size=32, prefill_step_size=512)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1_000_000)
    push.connect(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)

    def plain(model, tok, msgs) -> list[float]:
        gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8, prefill_step_size=512)
        gen.insert([tok.apply_chat_template(msgs, add_generation_prompt=True)], max_tokens=[tokens])
        times, done = [], False
        while not done:
            _, rs = gen.next()
            for r in rs:
                times.append(time.perf_counter())
                done = r.finish_reason is not None
        gen.close()
        return times

    def engine(msgs, sockets: bool, rid: str) -> list[float]:
        eng.submit(Submit(rid=rid, max_tokens=tokens, messages=msgs, temperature=0.0, ignore_eos=True))
        times = []
        while len(eng):
            if sockets:
                poller.poll(0)
            chunks, finished = eng.step()
            if chunks or finished:
                times.append(time.perf_counter())
            if sockets:
                if chunks:
                    push.send(encode(Tokens(chunks)), zmq.NOBLOCK)
                for f in finished:
                    push.send(encode(f), zmq.NOBLOCK)
                while True:  # the supervisor's side would drain it; keep the queue empty
                    try:
                        pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
        return times

    from worker.mlx_engine.decode_graph import DecodeGraph

    graphs = {"plain": None, "compiled": DecodeGraph(eng.model)}

    def with_graph(msgs, rid: str, graph: str) -> list[float]:
        """B with its solo decode steps plain ("plain"), or compiled ("compiled")."""
        default, eng.graph = eng.graph, graphs[graph]
        try:
            return engine(msgs, False, rid)
        finally:
            eng.graph = default

    from worker.mlx_engine import attention

    def fast_attention(fn):
        """`fn` with mx.fast's attention itself, not the worker's route (installed by the Engine on CUDA)."""
        def run(m, i):
            attention.install("fast")
            try:
                return fn(m, i)
            finally:
                attention.install("routed" if eng.attention_routed else "fast")
        return run

    variants = {
        "S_mlx_lm_stream_generate": lambda m, i: stream_times(model_a, tok_a, m, tokens),
        "S_stream_generate_engine_model": lambda m, i: stream_times(eng.model, eng.tokenizer, m, tokens),
        "S_stream_generate_fast_attention": fast_attention(lambda m, i: stream_times(model_a, tok_a, m, tokens)),
        "B_engine_fast_attention": fast_attention(lambda m, i: engine(m, False, f"f{i}")),
        "A_mlx_lm_load_batchgen": lambda m, i: plain(model_a, tok_a, m),
        "B_engine_submit_step": lambda m, i: engine(m, False, f"b{i}"),
        "E_engine_solo_uncompiled": lambda m, i: with_graph(m, f"e{i}", "plain"),
        "M_engine_graph_compiled": lambda m, i: with_graph(m, f"m{i}", "compiled"),
        "C_engine_model_plain_batchgen": lambda m, i: plain(eng.model, eng.tokenizer, m),
        "D_engine_plus_zmq_msgpack": lambda m, i: engine(m, True, f"d{i}"),
    }
    if picked := [v for v in os.environ.get("DIAG_ENGINE_VARIANTS", "").split(",") if v]:  # a few of them
        variants = {k: variants[k] for k in picked}
    for fn in variants.values():  # warm-up
        fn(prompts("ew", 1, 24, 0)[0], 999)
    out: dict = {k: [] for k in variants}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in names:
            out[name].append(itl_ms(variants[name](prompts(f"e{r}", 1, 24, 0)[0], r)))
    ctx.destroy(linger=0)
    engine_log.removeHandler(keep)
    return {"tokens": tokens, "solo_per_token_ms": perf_lines("\n".join(keep.lines)), "itl_p50_ms_per_round": out,
            "itl_p50_ms_median": {k: round(percentile(v, 50), 3) for k, v in out.items()}}


WORKER_VARIANTS = {
    "W_plain": [],
    "W_caches": ["--hot-cache-bytes", str(2 * 2**30), "--ssd-cache-root", "{tmp}/ssd"],
    "W_solo_plain": ["--solo", "plain"],
    "W_solo_compiled": ["--solo", "compiled"],
    "W_solo_off": ["--solo", "off"],
    # the daemon's default caches (supervisor/cache_config.py DEFAULTS): what the bench's mlxsup side runs
    "W_daemon_caches": ["--hot-cache-bytes", str(2**30), "--ssd-cache-root", "{tmp}/ssd"],
    "W_attention_fast": ["--attention", "fast"],
    # a sliding-window or recurrent model's lone request with caches on: the solo (its prefill stopping at snapshot
    # points), or the BatchGenerator at batch 1, where such a request always went before
    "W_caches_solo_off": ["--hot-cache-bytes", str(2 * 2**30), "--ssd-cache-root", "{tmp}/ssd", "--solo", "off"],
    # its main (decoding) thread alone on CPU 0, every other thread (ZeroMQ's I/O thread, CUDA's, the lifeline) on
    # 1-3: does another thread's work on the decoding thread's CPU (a wake-up per message) cost its ITL?
    "W_main_alone": ["PIN:0:1-3"],
}
# "ENV:K=V" entries are the worker's environment, not arguments; "PIN:MAIN:REST" pins the worker's main thread to
# CPUs MAIN and its other threads to REST once it is ready. --worker-variants or DIAG_WORKER_VARIANTS
# (W_plain,W_daemon_caches) picks some (default: the first five); DIAG_PYSPY=DIR records each one's measured rounds
# with py-spy (attached after Ready) into DIR/<variant>.txt


def pin_apart(pid: int, main: str, rest: str) -> None:
    """The main thread of `pid` onto CPUs `main`, its other threads onto `rest` (lists like '0' or '1-3')."""
    import psutil

    from bench.servers import parse_cpus

    for t in psutil.Process(pid).threads():
        os.sched_setaffinity(t.id, parse_cpus(main if t.id == pid else rest) or set())


def perf_lines(text: str) -> list[dict]:
    """The engine's `[perf] solo` debug lines (worker/mlx_engine/solo.py SoloTimes), rounds only (not warm-ups)."""
    out = []
    for m in re.finditer(r"\[perf\] solo rid=(\S+) tokens=(\d+) per_token_ms=(\{[^}]*\})", text):
        if m.group(1) != "warm" and not m.group(1).endswith("999"):
            out.append({"rid": m.group(1), "tokens": int(m.group(2)), **json.loads(m.group(3).replace("'", '"'))})
    return out


def part_affinity(model_dir: str, tokens: int, rounds: int) -> dict:
    """stream_generate in a subprocess pinned (taskset) to different CPU sets: is a process's single-stream speed
    a matter of where it runs (NUMA node of the GPU, shared cores)? With the host's NUMA and GPU topology."""
    n = os.cpu_count() or 2
    q = max(1, n // 4)
    sets = {"unpinned": None, "first_quarter": f"0-{q - 1}", "third_quarter": f"{n // 2}-{n // 2 + q - 1}",
            "last_core": str(n - 1)}
    if spec := os.environ.get("DIAG_AFFINITY_SETS"):  # NAME:CPUS,... instead, e.g. c0:0,c1:1,q:0-3
        sets = {name: cpus.replace("+", ",") or None for name, _, cpus in (x.partition(":") for x in spec.split(","))}
    out: dict = {"cpus": n}
    for cmd in (["lscpu"], ["nvidia-smi", "topo", "-m"]):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            out[cmd[0]] = [line for line in text.splitlines() if cmd[0] != "lscpu" or "NUMA" in line or "Model name" in line]
        except (OSError, subprocess.SubprocessError) as exc:
            out[cmd[0]] = repr(exc)
    for name, cpus in sets.items():
        out[name] = stream_subprocess(model_dir, tokens, rounds, cpus)
    itls = stream_itls(model_dir, tokens, rounds)  # last: this process holds no GPU context while the others run
    out["in_this_process"] = {"itl_p50_ms_per_round": itls, "itl_p50_ms_median": percentile(itls, 50)}
    return out


class BareWorker:
    """A worker subprocess over bare ZeroMQ (no daemon, no HTTP), as the harness that times its Tokens messages."""

    def __init__(self, model_dir: str, log: Path, extra: list[str] | tuple[str, ...] = (), env: dict | None = None,
                 cpus: str | None = None, main: list[str] | None = None) -> None:
        import zmq

        from protocol.codec import decode, encode
        self.decode, self.encode = decode, encode
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.log = log
        self.proc = subprocess.Popen([*(["taskset", "-c", cpus] if cpus else []), sys.executable, *(main or ["-m", "worker"]),
                                      "--model-path", model_dir, "--model-id", "m", "--endpoint",
                                      f"tcp://127.0.0.1:{port}", "--identity", "w", "--warm-batch-shapes", "off",
                                      *extra], cwd=REPO, env=env, stderr=open(log, "wb"))

    def recv(self, deadline: float):
        while not self.sock.poll(200):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"no message from the worker (exit {self.proc.returncode})")
        return self.decode(self.sock.recv_multipart()[1])

    def ready(self, timeout: float = 300) -> None:
        from protocol.messages import Ready
        deadline = time.monotonic() + timeout
        while not isinstance(self.recv(deadline), Ready):
            pass

    def one(self, msgs: list, rid: str, tokens: int) -> tuple[list[float], int]:
        """One greedy request: the arrival times of its Tokens messages and its Finished, and the tokens generated."""
        from protocol.messages import Finished, Submit, Tokens
        self.sock.send_multipart([b"w", self.encode(Submit(rid=rid, max_tokens=tokens, messages=msgs,
                                                           temperature=0.0, ignore_eos=True))])
        stamps, end = [], time.monotonic() + 120
        while True:
            m = self.recv(end)
            t = time.perf_counter()
            if isinstance(m, Tokens) and any(c[0] == rid and c[2] for c in m.chunks):
                stamps.append(t)
            elif isinstance(m, Finished) and m.rid == rid:
                stamps.append(t)
                return stamps, m.completion_tokens

    def burst(self, batch: list[list], tokens: int) -> dict[str, list[float]]:
        """Greedy requests sent at once, as a burst of clients reaches a worker: each one's start, then its chunks'
        arrival times (perf_counter), by request id."""
        from protocol.messages import Failed, Finished, Submit, Tokens
        t0 = time.perf_counter()
        times: dict[str, list[float]] = {}
        for i, msgs in enumerate(batch):
            rid = f"b{i}"
            times[rid] = [t0]
            self.sock.send_multipart([b"w", self.encode(Submit(rid=rid, max_tokens=tokens, messages=msgs,
                                                               temperature=0.0, ignore_eos=True))])
        left, end = set(times), time.monotonic() + 300
        while left:
            m, t = self.recv(end), time.perf_counter()
            if isinstance(m, Tokens):
                for c in m.chunks:
                    if c[0] in times and c[2]:
                        times[c[0]].append(t)
            elif isinstance(m, Failed):
                raise RuntimeError(f"the worker failed {m.rid}: {m.message}")
            elif isinstance(m, Finished) and m.rid in left:
                left.discard(m.rid)
        return times

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close(linger=0)
        self.ctx.term()


RAMP_VARIANTS = {  # a worker as the daemon starts it (the batch shapes warmed while idle), with and without caches
    "W_daemon_caches": ["--warm-batch-shapes", "auto", "--hot-cache-bytes", str(2**30), "--ssd-cache-root", "{tmp}/ssd"],
    "W_no_caches": ["--warm-batch-shapes", "auto"],
    "W_no_warm_up": [],
}


def part_ramp(model_dir: str, tokens: int, rounds: int, n: int = 32, cpus: str = "0-3") -> dict:
    """`n` greedy requests at once: to a worker over bare ZeroMQ (no daemon, no HTTP) and to mlx-lm's BatchGenerator
    in a process of its own (bench.inproc, the throughput section's ceiling), each pinned to `cpus`, in alternating
    rounds. TTFT p50 and tok/s per side: is the 32-stream ramp's extra TTFT the worker's, or the daemon's?"""
    from bench.prompts import prompts

    inproc = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-m", "bench.inproc", "--model", model_dir],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert inproc.stdin is not None and inproc.stdout is not None
    json.loads(inproc.stdout.readline())  # ready

    def inproc_burst(batch: list[list]) -> dict[str, list[float]]:
        inproc.stdin.write(json.dumps({"op": "run", "mode": "batch", "messages": batch, "max_tokens": tokens}) + "\n")
        inproc.stdin.flush()
        out = json.loads(inproc.stdout.readline())
        return {str(i): [0.0, *r["times"]] for i, r in enumerate(out["records"])}

    tmp = tempfile.mkdtemp(prefix="diagramp-")
    workers = {}
    for name, extra in RAMP_VARIANTS.items():
        log_path = Path(tmp) / f"{name}.log"
        workers[name] = BareWorker(model_dir, log_path, ["--log-level", "DEBUG", *[a.format(tmp=f"{tmp}/{name}")
                                                                                 for a in extra]], cpus=cpus)
    sides = {"inproc_all": inproc_burst, **{k: (lambda b, w=w: w.burst(b, tokens)) for k, w in workers.items()}}
    out: dict = {k: [] for k in sides}
    try:
        for w in workers.values():
            w.ready()
        for name, fn in sides.items():  # warm-up: the shapes of a burst, once
            fn(prompts(f"rw{name}", n, 24, 0))
        import mlx.core as mx
        for name, w in workers.items():  # a worker's own warm-up (auto: on a GPU) runs while idle: wait for its end
            deadline = time.monotonic() + 60
            while ("auto" in RAMP_VARIANTS[name] and mx.default_device() == mx.gpu and time.monotonic() < deadline
                   and "batch_shapes" not in w.log.read_text()):
                time.sleep(0.2)
        for r in range(rounds):
            names = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in names:
                times = sides[name](prompts(f"r{r}", n, 24, 0))
                t0 = min(v[0] for v in times.values())
                end = max(v[-1] for v in times.values())
                ttft = [v[1] - v[0] for v in times.values()]
                out[name].append({"ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1),
                                  "ttft_max_ms": round(max(ttft) * 1e3, 1),
                                  "tok_s": round(n * tokens / (end - t0), 1)})
    finally:
        for w in workers.values():
            w.stop()
        inproc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        inproc.stdin.close()
        inproc.wait(30)
    steps = {name: [line.split("] ", 1)[-1] for line in w.log.read_text().splitlines()
                    if "[step]" in line or "[admit]" in line][-40:] for name, w in workers.items()}
    med = {k: {m: percentile([x[m] for x in v], 50) for m in ("ttft_p50_ms", "tok_s")} for k, v in out.items()}
    return {"n": n, "tokens": tokens, "cpus": cpus, "per_round": out, "median": med, "last_steps": steps}


def part_worker(model_dir: str, tokens: int, rounds: int, words: int = 24, variants: list[str] | None = None) -> dict:
    import signal

    from bench.prompts import prompts

    out: dict = {}
    # the same measure for stream_generate in a process of its own, spawned alike: the baseline for W_*
    out["P_stream_generate_subprocess"] = stream_subprocess(model_dir, tokens, rounds)
    from bench.profile import Spy, find_pyspy

    picked = variants or [v for v in os.environ.get("DIAG_WORKER_VARIANTS", "").split(",") if v] \
        or list(WORKER_VARIANTS)[:5]
    for name in picked:
        extra = WORKER_VARIANTS[name]
        env = dict(os.environ, **dict(a[4:].split("=", 1) for a in extra if a.startswith("ENV:")))
        tmp = tempfile.mkdtemp(prefix="diagw-")
        pin = next((a[4:].split(":") for a in extra if a.startswith("PIN:")), None)
        extra = [a.format(tmp=tmp) for a in extra if not a.startswith(("ENV:", "PIN:"))]
        worker = BareWorker(model_dir, Path(tmp) / "worker.log", ["--log-level", "DEBUG", *extra], env)
        spy = None
        try:
            worker.ready()
            if pin is not None:
                pin_apart(worker.proc.pid, *pin)
            worker.one(prompts("ew", 1, words, 0)[0], "warm", tokens)
            if os.environ.get("DIAG_PYSPY") and (exe := find_pyspy()) is not None:
                spy = Spy(exe, worker.proc.pid, Path(os.environ["DIAG_PYSPY"]) / f"{name}.txt", rate=500)
                spy.start()
                time.sleep(0.5)
            itls, tps, msgs_per_tok = [], [], []
            for r in range(rounds):
                stamps, n = worker.one(prompts(f"e{r}", 1, words, 0)[0], f"r{r}", tokens)
                itls.append(itl_ms(stamps))
                tps.append(round((n - 1) / (stamps[-1] - stamps[0]), 1))
                msgs_per_tok.append(round(len(stamps) / max(n, 1), 3))
            out[name] = {"args": extra, "itl_p50_ms_per_round": itls, "tok_s_after_first_per_round": tps,
                         "messages_per_token": msgs_per_tok, "itl_p50_ms_median": percentile(itls, 50)}
            wait_until, lines = time.monotonic() + 5, []
            while time.monotonic() < wait_until:  # the last round's [perf] line reaches the log after its Finished
                lines = perf_lines(worker.log.read_text(errors="replace"))
                if len(lines) >= rounds or "--solo" in extra:
                    break
                time.sleep(0.05)
            out[name]["solo_per_token_ms"] = lines
        except Exception as exc:
            out[name] = {"error": repr(exc), "log_tail": worker.log.read_text(errors="replace")[-2000:]}
        finally:
            if spy is not None and spy.proc is not None:
                spy.proc.send_signal(signal.SIGINT)
                try:
                    spy.proc.wait(30)
                except subprocess.TimeoutExpired:
                    spy.proc.kill()
            worker.stop()
    return {"tokens": tokens, **out}


def part_isolate(model_dir: str, tokens: int, rounds: int, words: int = 24) -> dict:
    """The single stream's ITL, rounds interleaved: stream_generate in a process on CPUs 0-3 and one on CPU 0 alone, a
    worker over bare ZeroMQ on 0-3 (W_plain), a worker whose main thread is alone on CPU 0, its other threads on 1-3
    (W_main_alone), one with the daemon's default prompt caches (W_daemon_caches), and `mlxsup serve` on 0-3 over HTTP
    as configured by default (D_http), with its caches off (D_http_nocache), and with the daemon on CPUs 4-7 and only
    its worker on 0-3 (D_http_apart), each worker's batch-shape warm-up awaited: is the worker's extra time per token
    its other threads' work on the decoding CPU, or its caches', and what does the daemon add? This harness runs on
    the CPUs outside 0-3, as the throughput section's client does."""
    import asyncio

    from bench import servers
    from bench.client import chat_body, stream_chat
    from bench.cpu_siblings import CHILD
    from bench.prompts import prompts

    if hasattr(os, "sched_setaffinity") and (rest := os.sched_getaffinity(0) - {0, 1, 2, 3}):
        os.sched_setaffinity(0, rest)
    sides = ["S_cpus0-3", *[v for v in os.environ.get("DIAG_ISOLATE_SIDES", "").split(",") if v]] if \
        os.environ.get("DIAG_ISOLATE_SIDES") else None  # some of them (default: all)

    def wanted(name: str) -> bool:
        return sides is None or name in sides

    streams = {}
    for name, cpus in [x for x in (("S_cpus0-3", "0-3"), ("S_cpu0", "0")) if wanted(x[0])]:
        streams[name] = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-c", CHILD, model_dir], cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tmp = tempfile.mkdtemp(prefix="diagiso-")
    workers = {name: BareWorker(model_dir, Path(tmp) / f"{name}.log", ["--log-level", "INFO", *[
        a.format(tmp=f"{tmp}/{name}") for a in WORKER_VARIANTS[name] if not a.startswith("PIN:")]], cpus="0-3")
        for name in ("W_plain", "W_main_alone", "W_daemon_caches") if wanted(name)}
    servers.SERVER_CPUS = servers.parse_cpus("0-3")
    (Path(tmp) / "nocache.toml").write_text("[cache]\nhot_budget = 0\nssd = false\n")
    daemons = {"D_http": servers.Mlxsup(Path(model_dir).parent, Path(tmp) / "daemon"),
               "D_http_nocache": servers.Mlxsup(Path(model_dir).parent, Path(tmp) / "daemon-nocache",
                                                args=["--config", str(Path(tmp) / "nocache.toml")])}
    if wanted("D_http_apart"):  # the daemon on CPUs 4-7, its worker's threads moved to 0-3 once it serves
        daemons["D_http_apart"] = servers.Mlxsup(Path(model_dir).parent, Path(tmp) / "daemon-apart")
    daemons = {k: v for k, v in daemons.items() if wanted(k)}
    model_id = Path(model_dir).name
    out: dict = {k: [] for k in [*streams, *workers, *daemons]}
    try:
        for name, d in daemons.items():
            servers.SERVER_CPUS = servers.parse_cpus(os.environ.get("DIAG_ISOLATE_APART", "4-7")
                                                     if name == "D_http_apart" else "0-3")
            asyncio.run(d.start())
        for p in streams.values():
            assert p.stdout is not None
            while p.stdout.readline().strip() != "ready":
                if p.poll() is not None:
                    raise RuntimeError("a stream_generate child did not start")
        for w in workers.values():
            w.ready()
        if "W_main_alone" in workers:
            pin_apart(workers["W_main_alone"].proc.pid, "0", "1-3")

        def side(name: str, r: int) -> float:
            msgs = prompts(f"i{r}", 1, words, 0)[0]
            if name in streams:
                p = streams[name]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(f"{tokens}\n")
                p.stdin.flush()
                return round(float(p.stdout.readline()), 3)
            if name in daemons:
                rec = asyncio.run(stream_chat(daemons[name].chat_url, chat_body(model_id, msgs, tokens,
                                                                                {"ignore_eos": True}), 120))
                return itl_ms(rec["times"])
            return itl_ms(workers[name].one(msgs, f"r{r}", tokens)[0])

        names = list(out)
        for name in names:
            side(name, -1)  # warm-up
        for d in daemons.values():  # each worker's idle warm-up (a GPU's) is over
            asyncio.run(d.warmed_up(model_id, timeout=90))
        if "D_http_apart" in daemons and (pid := daemons["D_http_apart"].pid) is not None:
            import psutil
            for child in psutil.Process(pid).children(recursive=True):
                if "--model-path" in child.cmdline():  # the serving worker, not the spare
                    pin_apart(child.pid, "0-3", "0-3")
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in (order if r % 2 == 0 else order[::-1]):
                out[name].append(side(name, r))
    finally:
        for p in streams.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(30)
        for w in workers.values():
            w.stop()
        for d in daemons.values():
            asyncio.run(d.stop())
    med = {k: percentile(v, 50) for k, v in out.items()}
    ratio = {k: round(percentile([a / b for a, b in zip(v, out["S_cpus0-3"])], 50), 3) for k, v in out.items()}
    fast = {k: round(percentile(v, 25), 3) for k, v in out.items()}  # the host's fast speed: a side's faster rounds
    return {"tokens": tokens, "itl_p50_ms_per_round": out, "itl_p50_ms_median": med,
            "ratio_to_S_cpus0-3_median": ratio, "itl_p50_ms_p25_of_rounds": fast}


def part_store(model_dir: str, n: int, tokens: int, rounds: int) -> dict:
    import tempfile

    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.prompt_cache import CacheOptions

    spent = {"step": 0.0, "store": 0.0}

    def timed(fn, key: str):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    with tempfile.TemporaryDirectory() as root:
        eng = Engine(Path(model_dir), max_batch_size=max(32, n), prefill_step_size=2048,
                     cache=CacheOptions(hot_bytes=1 << 30, ssd_root=Path(root)))
        caches = eng.caches
        assert caches is not None
        caches.store = timed(caches.store, "store")  # type: ignore[method-assign]
        if hasattr(caches, "hand_off"):
            caches.hand_off = timed(caches.hand_off, "store")  # type: ignore[method-assign]
        step = timed(eng.step, "step")
        per_round = []
        for r in range(rounds + 1):  # round 0 warms up
            spent["step"] = spent["store"] = 0.0
            for i in range(n):
                ids = [(r * 7919 + i * 104729 + j * 31) % (eng.vocab_size - 10) + 10 for j in range(4 * 64 + 5)]  # distinct prompts
                eng.submit(Submit(rid=f"s{r}-{i}", max_tokens=tokens, prompt_ids=ids, temperature=0.0,
                                  ignore_eos=True))
            while len(eng):
                step()
            if r:
                per_round.append({"step_s": round(spent["step"], 4), "store_s": round(spent["store"], 4),
                                  "store_pct": round(100 * spent["store"] / spent["step"], 2)})
        eng.close_caches()
    return {"requests": n, "tokens": tokens, "rounds": per_round,
            "store_pct_median": percentile([x["store_pct"] for x in per_round], 50)}


def part_chains(rounds: int, n: int = 32, tokens: int = 320) -> dict:
    import tempfile

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import KVCache

    from worker.mlx_engine.prompt_cache import CacheOptions, PromptCaches

    class Shape1b(nn.Module):
        def make_cache(self) -> list:
            return [KVCache() for _ in range(16)]

    def finished(seed: int) -> list:
        layers = []
        for layer in range(16):
            c = KVCache()
            k = mx.random.normal((1, 8, tokens, 64), key=mx.random.key(seed * 16 + layer)).astype(mx.bfloat16)
            c.update_and_fetch(k, k)
            layers.append(c)
        mx.eval([x for c in layers for x in (c.keys, c.values)])
        return layers

    work = mx.random.normal((1024, 1024))
    out = []
    with tempfile.TemporaryDirectory() as root:
        pc = PromptCaches(Shape1b(), Path(root), CacheOptions(hot_bytes=1 << 30, ssd_root=Path(root), close_s=120))
        for r in range(rounds + 1):
            seqs = [(list(range(r * 100_000 + i * 1000, r * 100_000 + i * 1000 + tokens)), finished(r * n + i))
                    for i in range(n)]
            t0, c0 = time.perf_counter(), time.thread_time()
            for ids, cache in seqs:
                pc.store(ids, cache)
            t1, c1 = time.perf_counter(), time.thread_time()
            mx.eval(work @ work @ work)  # the next step's MLX work
            t2, c2 = time.perf_counter(), time.thread_time()
            if hasattr(pc, "hand_off"):
                pc.hand_off()
            t3, c3 = time.perf_counter(), time.thread_time()
            if r:  # wall time on the main thread, and its CPU time (the machine is shared: wall is noisy)
                out.append({"store_ms": round((t1 - t0) * 1e3, 2), "hand_off_ms": round((t3 - t2) * 1e3, 2),
                            "main_thread_ms": round((t1 - t0 + t3 - t2) * 1e3, 2),
                            "main_thread_cpu_ms": round((c1 - c0 + c3 - c2) * 1e3, 2)})
        t4 = time.perf_counter()
        pc.close()
        close_s = time.perf_counter() - t4
    return {"sequences": n, "tokens": tokens, "rounds": out, "close_s": round(close_s, 2),
            "main_thread_ms_median": percentile([x["main_thread_ms"] for x in out], 50),
            "main_thread_cpu_ms_median": percentile([x["main_thread_cpu_ms"] for x in out], 50)}


def part_loads(model_dir: str, tokens: int, rounds: int) -> dict:
    """stream_generate on the same weights loaded three ways in one process, interleaved: mlx_lm.load (evaluated at
    once), the worker's load_with_progress (lazily, leaf by leaf), mlx_lm.load again (the order of loading); and the
    worker's model under its attention route. Is the worker's model itself slower to decode?"""
    from mlx_lm import load

    from bench.prompts import prompts
    from worker.mlx_engine import attention
    from worker.mlx_engine.loading import load_with_progress

    first = load(model_dir)
    worker = load_with_progress(Path(model_dir), lambda *_: None)
    again = load(model_dir)

    def routed(m, i):
        attention.install("routed")
        try:
            return stream_times(*worker, m, tokens)
        finally:
            attention.install("fast")

    variants = {"load_first": lambda m, i: stream_times(*first, m, tokens),
                "load_with_progress": lambda m, i: stream_times(*worker, m, tokens),
                "load_again": lambda m, i: stream_times(*again, m, tokens),
                "load_with_progress_routed": routed}
    for fn in variants.values():
        fn(prompts("ew", 1, 24, 0)[0], -1)
    out: dict = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if r % 2 == 0 else order[::-1]):
            out[name].append(itl_ms(variants[name](prompts(f"e{r}", 1, 24, 0)[0], r)))
    return {"tokens": tokens, "itl_p50_ms_per_round": out,
            "itl_p50_ms_median": {k: round(percentile(v, 50), 3) for k, v in out.items()},
            "ratio_to_load_first_median": {k: round(percentile([a / b for a, b in zip(v, out["load_first"])], 50), 3)
                                           for k, v in out.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diagnose")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="imports,exit,arrival")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, default=24, help="worker: the prompts' words (over a cache block: ~50)")
    ap.add_argument("--worker-variants", help="worker: the W_* variants to run, comma-separated (default: all)")
    args = ap.parse_args()
    res: dict = {"python": sys.executable, "env_pythonpath": os.environ.get("PYTHONPATH")}
    if route := os.environ.get("MLXSUP_DIAG_ATTENTION"):  # the worker's attention setting, for the in-process parts
        from worker.mlx_engine.attention import install
        res["attention_routed"] = install(route)
    for part in args.parts.split(","):
        t = time.perf_counter()
        try:
            if part == "imports":
                res[part] = part_imports()
            elif part == "exit":
                res[part] = part_exit(args.model, args.rounds)
            elif part == "loads":
                res[part] = part_loads(args.model, 256, max(3, args.rounds))
            elif part == "engine":
                res[part] = part_engine(args.model, 256, max(3, args.rounds))
            elif part == "affinity":
                res[part] = part_affinity(args.model, 256, max(3, args.rounds))
            elif part == "worker":
                res[part] = part_worker(args.model, 256, max(3, args.rounds), args.words,
                                        args.worker_variants.split(",") if args.worker_variants else None)
            elif part == "isolate":
                res[part] = part_isolate(args.model, 256, max(3, args.rounds), args.words)
            elif part == "store":
                res[part] = part_store(args.model, 32, 8, args.rounds)
            elif part == "chains":
                res[part] = part_chains(args.rounds)
            elif part == "ramp":
                res[part] = part_ramp(args.model, 256, max(3, args.rounds))
            elif part == "arrival":
                res[part] = part_arrival(args.model, 32, 256, args.rounds)
            elif part == "prefill_shapes":
                res[part] = prefill_shapes(args.model)
            elif part == "long":
                res[part] = part_long(args.model, rounds=max(2, args.rounds))
            elif part == "cudnn":
                res[part] = part_cudnn(args.model, args.rounds)
        except Exception as exc:
            res[part] = {"error": repr(exc)}
        res.setdefault("elapsed_s", {})[part] = round(time.perf_counter() - t, 1)
        print(f"[diagnose] {part}: {json.dumps(res[part])[:1500]}", file=sys.stderr, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
