"""Time to first token for one long prompt: cold, hot-cache hit, and SSD hit after evict + reload.

    .venv/bin/python bench/cache_bench.py [--preset small] [--arch llama,gemma3,qwen3_5] [--kv-bits 0,8]
                                          [--tokens 2048] [--out bench/results]

For each architecture (and each kv_bits), runs a real daemon (`mlxsup serve`) on a random-weight
model made with `mlxsup make-model --arch`, in a scratch state directory, and talks to it over
HTTP like any client:

1. cold: a prompt of at least --tokens tokens that no cache has seen;
2. hot: the same prompt again (served from the worker's hot cache);
3. ssd: the model is evicted (the worker process exits, its hot cache with it) and loaded
   again; the same prompt once more, now served from the SSD cache. The reload is timed
   apart: TTFT starts when the request is sent to a loaded model.

TTFT is the time from sending a streamed completion to its first SSE data line with text (the
first token; a chunk sent before it carries none). Each run also checks that the greedy output is the same in all three cases, and that
usage.prompt_tokens_details.cached_tokens says what the cache served. Writes
<out>/cache_bench.json and <out>/cache_bench.md (with a description of the machine).

Each hit is judged against what the memory it comes from allows, measured in the same run:
hot TTFT <= 2 decode steps + 10 ms; SSD TTFT <= K/V bytes read / the disk's sequential read
bandwidth + 2 decode steps + 20 ms. The decode step is the cold run's inter-token time
((last token - first token) / (tokens - 1), at the same context); the bandwidth is a fresh
file's read under the work folder with its pages dropped (bench/disk_read.py); the K/V bytes
are what the worker's hit log says the SSD gave. Before the SSD hit the block files' pages are
dropped too (--page-cache keep: left as the writer left them), so it reads from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: bench/ is not a package on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.disk_read import drop_from_page_cache, sequential_read_gbs

ROOT = Path(__file__).resolve().parent.parent
SLACK_S = {"hot": 0.010, "ssd": 0.020}  # bookkeeping allowed on top of 2 decode steps (and the SSD's read)


def machine() -> dict:
    import mlx.core as mx
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"os": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "mlx": mx.__version__, "device": str(mx.default_device())}


def make_prompt(model: Path, n_tokens: int) -> tuple[str, int]:
    """Pseudo-text of at least `n_tokens` tokens (counted with the model's own tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = "the lighthouse keeper wrote down every ship that passed in the long winter night".split()
    text, i = "Benchmark prompt.", 0
    while len(tok.encode(text).ids) < n_tokens:
        text += " " + " ".join(words[(i + j) % len(words)] for j in range(50)) + f" {i}."
        i += 1
    return text, len(tok.encode(text).ids)


class Daemon:
    def __init__(self, state: Path, config: Path) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.state = state
        self.log = open(state / "daemon.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--port", "0", "--state-dir",
                                      str(state), "--config", str(config)], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.url = json.loads((state / "daemon.json").read_text())["url"]
                break
            except (OSError, ValueError, KeyError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start; see {state / 'daemon.log'}") from None
                time.sleep(0.1)
        self.http = httpx.Client(base_url=self.url, timeout=3600)

    def post(self, path: str, body: dict | None = None) -> dict:
        r = self.http.post(path, json=body or {})
        r.raise_for_status()
        return r.json()

    def model(self, model_id: str) -> dict:
        return next(m for m in self.http.get("/api/status").json()["models"] if m["id"] == model_id)

    def ttft(self, model_id: str, prompt: str, max_tokens: int) -> dict:
        body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first, last, text, usage = None, 0.0, "", None
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if any(c.get("text") for c in chunk.get("choices", [])):  # not a chunk without a token (usage)
                    last = time.perf_counter() - t0
                    first = first if first is not None else last
                text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
                usage = chunk.get("usage") or usage
        n = usage["completion_tokens"]
        return {"ttft_s": round(first, 4), "text": text, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "completion_tokens": n,
                "decode_step_s": round((last - first) / (n - 1), 4) if n > 1 else None}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        self.log.close()


def wait_for_ssd(d: Daemon, model_id: str, blocks: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while (d.model(model_id).get("cache") or {}).get("ssd", {}).get("entries", 0) < blocks:
        if time.monotonic() > deadline:
            raise SystemExit("the SSD cache did not get the prompt's blocks in time")
        time.sleep(0.2)


def run(args: argparse.Namespace, work: Path, arch: str, kv_bits: int, disk: dict) -> dict:
    model = work / "models" / f"{args.preset}-{arch}"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(model), "--preset", args.preset,
                        "--arch", arch], check=True, cwd=ROOT)
    prompt, n_tokens = make_prompt(model, args.tokens)
    config = work / "bench.toml"
    config.write_text(f'[models.m]\npath = "{model}"\n\n[cache]\nhot_budget = "4GiB"\nssd_cap = "8GiB"\n'
                      f"kv_bits = {kv_bits}\n")
    d = Daemon(work / f"state-{arch}-{kv_bits}", config)
    try:
        d.post("/api/models/m/load")
        # first-call costs out of the way: kernels for the prefill's chunk shapes (compiled on first use on a
        # GPU) and for a hit's, on a prompt as long as the measured one that shares no block with it
        warmup = "A short warm-up prompt." if args.short_warmup else "Warm-up. " + prompt
        for _ in range(1 if args.short_warmup else 2):
            d.ttft("m", warmup, 2)
        cold = d.ttft("m", prompt, args.max_tokens)
        hots = [d.ttft("m", prompt, args.max_tokens) for _ in range(args.rounds)]
        deadline = time.monotonic() + 10  # cache stats come with the worker's heartbeats
        while (cache_hot := d.model("m")["cache"])["hot"]["entries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        block = cache_hot["block_tokens"]
        chains = 1 if args.short_warmup else 2  # the warm-up prompt's chain is on disk too: it warms the reload
        wait_for_ssd(d, "m", chains * (hots[0]["cached_tokens"] // block))  # hybrids keep blocks up to a snapshot
        ssds, hits = [], []
        for i in range(args.rounds):  # each round a fresh worker: evicted (its hot cache with it) and loaded again
            evict = d.post("/api/models/m/evict", {"mode": "drain"})
            t0 = time.perf_counter()
            d.post("/api/models/m/load")
            reload_s = time.perf_counter() - t0
            # the fresh worker's first hit pays its kernels' first use (a GPU compiles per shape): measured on the
            # warm-up prompt's chain, then the measured prompt's hit, as warm as the cold and hot runs were
            dropped = drop_blocks(d, args.page_cache)
            ssd_first = d.ttft("m", warmup, 2) if not args.short_warmup and i == 0 else None
            dropped = drop_blocks(d, args.page_cache) or dropped
            ssds.append(d.ttft("m", prompt, args.max_tokens))
            hits.append(hit_lines(d)[-1])  # this round's SSD hit
        cache = d.model("m")["cache"]
    finally:
        d.stop()
    hot, ssd = middle(hots), middle(ssds)
    same = all(r["text"] == cold["text"] for r in hots + ssds)
    step = cold["decode_step_s"]
    ssd_bytes = int(_field(hits[ssds.index(ssd)], "ssd_bytes") or 0)
    hot_hits = [h for h in hit_lines(d) if _field(h, "ssd_tokens") == "0"]
    bounds = {"hot": 2 * step + SLACK_S["hot"],
              "ssd": ssd_bytes / (disk["gbs"] * 1e9) + 2 * step + SLACK_S["ssd"]}
    return {"arch": arch, "kv_bits": kv_bits, "preset": args.preset, "prompt_tokens": cold["prompt_tokens"],
            "max_tokens": args.max_tokens, "block_tokens": block, "cold": cold, "hot": hot, "ssd": ssd,
            "greedy_output_identical": same,
            "hot_ratio": round(hot["ttft_s"] / cold["ttft_s"], 4),
            "ssd_ratio": round(ssd["ttft_s"] / cold["ttft_s"], 4),
            "hot_cache_bytes": cache_hot["hot"]["bytes"], "hot_cache_entries": cache_hot["hot"]["entries"],
            "ssd_first_request_ttft_s": ssd_first and ssd_first["ttft_s"], "hit_log": hot_hits[-1:] + hits,
            "rounds": args.rounds, "hot_ttft_rounds_s": [r["ttft_s"] for r in hots],
            "ssd_ttft_rounds_s": [r["ttft_s"] for r in ssds],
            "reload_s": round(reload_s, 3), "evict_phases_s": evict.get("phases_s"), "cache_after": cache,
            "tokenizer_prompt_tokens": n_tokens, "decode_step_s": step, "ssd_kv_bytes": ssd_bytes,
            "hot_kv_bytes": int(_field(hot_hits[-1], "bytes") or 0) if hot_hits else None,
            "disk_read_gbs": disk["gbs"], "page_cache": args.page_cache, "ssd_page_cache_dropped_bytes": dropped,
            "bound_s": {k: round(v, 4) for k, v in bounds.items()},
            "met": {"hot": hot["ttft_s"] <= bounds["hot"], "ssd": ssd["ttft_s"] <= bounds["ssd"]}}


def middle(runs: list[dict]) -> dict:
    """The run of median TTFT (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["ttft_s"])[len(runs) // 2]


def hit_lines(d: Daemon) -> list[str]:
    """The worker logs' hit lines so far, oldest first (tokens, bytes from each tier, find_s, read_s, join_s)."""
    return [line.split("[cache] ", 1)[1] for log in sorted((d.state / "logs").glob("worker-m*.log"))
            for line in log.read_text(errors="replace").splitlines() if " hit tokens=" in line]


def _field(line: str, name: str) -> str | None:
    """A key=value field of a worker log line."""
    return next((part.split("=", 1)[1] for part in line.split() if part.startswith(name + "=")), None)


def drop_blocks(d: Daemon, how: str) -> int:
    """Drop the SSD cache's block files from the page cache (unless `how` is keep); the bytes dropped."""
    return 0 if how == "keep" else drop_from_page_cache((d.state / "cache").glob("*/*.kvb"))


def verdict(r: dict, kind: str) -> str:
    return f"{r[kind]['ttft_s']:.3f} <= {r['bound_s'][kind]:.3f} ({'met' if r['met'][kind] else 'MISSED'})"


def markdown(runs: list[dict], m: dict, command: str, disk: dict) -> str:
    first = runs[0]
    lines = [
        "# Prompt cache benchmark: time to first token", "",
        f"`{command}`", "",
        f"Random-weight `{first['preset']}` models (mlxsup make-model, one per architecture), the same pseudo-text "
        f"prompt of ~{first['prompt_tokens']} tokens, greedy, {first['max_tokens']} tokens generated, blocks of "
        f"{first['block_tokens']} tokens. Cold: a prompt no cache has seen; hot: the same again; SSD: after an evict "
        "and a reload (new worker, empty hot cache; the reload is not in the TTFT), measured after the fresh "
        "worker's first hit (on the warm-up prompt's chain, which pays the kernels' first use on a GPU and is "
        "shown apart). Bounds: hot <= 2 decode steps + 10 ms; SSD <= K/V bytes read / disk read bandwidth + 2 decode "
        "steps + 20 ms; the decode step is the cold run's inter-token time. Disk: "
        f"{disk['gbs']:.2f} GB/s sequential read ({disk['file_mib']} MiB fresh file, {disk['method']}; rounds "
        f"{', '.join(map(str, disk['gbs_rounds']))}); the SSD hit's block files were "
        f"{'left in the page cache' if first['page_cache'] == 'keep' else 'dropped from the page cache first'}.", "",
        "| model | caches | kv_bits | prompt tokens | cold TTFT (s) | decode step (s) | hot TTFT <= bound (s) | "
        "hot / cold | K/V read from SSD (MiB) | SSD TTFT <= bound (s) | SSD / cold | SSD, fresh worker's first hit (s) "
        "| cached tokens | hot cache MiB | same greedy output |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        lines.append(
            f"| {r['arch']} | {CACHES.get(r['arch'], '')} | {r['kv_bits'] or '-'} | {r['prompt_tokens']} | "
            f"{r['cold']['ttft_s']:.3f} | {r['decode_step_s']:.4f} | {verdict(r, 'hot')} | {r['hot_ratio']:.1%} | "
            f"{r['ssd_kv_bytes'] / 2**20:.1f} | {verdict(r, 'ssd')} | {r['ssd_ratio']:.1%} | "
            f"{'-' if r.get('ssd_first_request_ttft_s') is None else format(r['ssd_first_request_ttft_s'], '.3f')} | "
            f"{r['ssd']['cached_tokens']} | "
            f"{r['hot_cache_bytes'] / 2**20:.2f} | {r['greedy_output_identical']} |")
    lines += [""] + [f"{r['arch']} kv_bits {r['kv_bits'] or '-'}: hot TTFT rounds {r['hot_ttft_rounds_s']} s, SSD "
                     f"{r['ssd_ttft_rounds_s']} s (the table shows each one's median); the hits' worker log: "
                     + "; ".join(f"`{h}`" for h in r["hit_log"]) for r in runs]
    lines += ["", "Cached tokens: a model whose layers are all `KVCache` reuses the whole prompt less its last "
              "token (its partial last block too, from either tier); one with sliding-window or recurrent layers reuses up to the snapshot taken "
              "at the prompt's last block boundary. With `kv_bits` the cached K/V are stored quantized: a smaller "
              "hot cache, and greedy output that may differ from the cold run. Exact greedy parity of cached and "
              "uncached runs is tested on the CPU with float32 models (tests/families); random bf16 weights on a "
              "GPU sit near argmax ties, where the chunking of a prefill (which the step cost model sizes from "
              "timings) can flip a token: two cold runs of one model can differ there too.", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}; "
              f"MLX {m['mlx']} on {m['device']}; Python {m['python']}.", ""]
    return "\n".join(lines)


CACHES = {"llama": "KVCache blocks", "qwen3": "KVCache blocks", "qwen3_moe": "KVCache blocks",
          "gemma3": "blocks + RotatingKVCache snapshots", "gpt_oss": "blocks + RotatingKVCache snapshots",
          "qwen3_5": "blocks + ArraysCache snapshots"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small", "1b"])
    p.add_argument("--arch", default="llama,gemma3,qwen3_5",
                   help="comma-separated make-model architectures, one run each (default llama,gemma3,qwen3_5)")
    p.add_argument("--kv-bits", default="0", help="comma-separated kv_bits per architecture run (0: as computed)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length, at least (default 2048)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="hot hits, and SSD hits each after a reload (default 3)")
    p.add_argument("--short-warmup", action="store_true",
                   help="warm up on a short prompt only (a CPU compiles no per-shape kernels: saves a long prefill)")
    p.add_argument("--page-cache", default="drop", choices=["drop", "keep"],
                   help="drop the SSD block files' pages before the SSD hit (default), or keep them")
    p.add_argument("--disk-mib", type=int, default=512, help="the bandwidth probe's file size (default 512 MiB)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args(argv)
    command = "python bench/cache_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    with tempfile.TemporaryDirectory(prefix="mlxsup-bench-") as tmp:
        work = args.work or Path(tmp)
        disk = sequential_read_gbs(work, args.disk_mib)  # where the SSD cache's blocks will lie
        print(f"disk sequential read: {disk['gbs']:.2f} GB/s ({disk['method']})", flush=True)
        for arch in args.arch.split(","):
            for bits in (int(b) for b in args.kv_bits.split(",")):
                r = run(args, work, arch, bits, disk)
                runs.append(r)
                print(f"{arch} kv_bits={bits} decode_step_s={r['decode_step_s']} hot {verdict(r, 'hot')}; "
                      f"ssd ({r['ssd_kv_bytes'] / 2**20:.1f} MiB) {verdict(r, 'ssd')}", flush=True)
    m = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_bench.json").write_text(json.dumps({"command": command.strip(), "machine": m, "disk": disk,
                                                           "runs": runs}, indent=2) + "\n")
    md = markdown(runs, m, command.strip(), disk)
    (args.out / "cache_bench.md").write_text(md)
    print(md)
    ok = all(r["greedy_output_identical"] or r["kv_bits"] for r in runs) and all(
        met for r in runs for met in r["met"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
