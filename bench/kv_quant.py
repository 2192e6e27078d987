"""The running K/V cache quantized (`[cache] kv_bits`, issue 53): quality, memory and speed against full precision.

    python -m bench.kv_quant --out bench/results/cpu/kv_quant/results.json                 # every section
    python -m bench.kv_quant --sections memory --tokens 16384 --out F.json                  # one of them
    python -m bench.kv_quant --sections memory,speed --memory-preset 1b --speed-presets 1b --dtype bfloat16 \
        --tokens 65536 --chunk 2048 --short 65536 --decode 256 --rounds 3 --out F.json      # a GPU, long context

In one process on the worker's own classes (no sockets), MLX on whatever device it has:

- **quality** (the real SmolLM2-135M-Instruct, imported as `serve --demo` does; `--demo-model DIR` to reuse one):
  greedy tokens of the recorded reference prompts (tests/fixtures/smollm2/greedy.json) through the Engine at full
  precision, 8 and 4 bits, against each other and against the recorded reference; and over a fixed text of
  `--text-tokens` tokens (docs/architecture.md as of commit TEXT_COMMIT), teacher-forced in chunks into the
  running cache as a prefill writes it, each position's log-probability of the text's next token: the mean and
  worst absolute difference from full precision.
- **memory**: a random-weight llama (`--memory-preset`, `--dtype`, head dimension 64) prefilled with `--tokens` tokens
  by the solo lane (solo.py, `--chunk` tokens a step, quantized as it goes), each bit width in a process of its
  own: the K/V bytes its cache holds (every layer's buffers: the peak, as a prefill only grows them), MLX's
  peak allocation and the process's peak resident size, both prefill included.
- **speed**: per `--speed-presets` model, decode tokens a second of one short request (`--short` prompt tokens, `--decode` out) through the
  Engine, full / 8 / 4 bits in interleaved rounds (the order reversed every other round): the median of each
  round's ratio to full precision and its spread, for the whole request (prefill included) and for its decode alone
  (from the first token out to the last: a long `--short` prompt's decode at long context), and the TTFT.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2" / "greedy.json"
TEXT_COMMIT = "0c8d012"  # the fixed text: docs/architecture.md at this commit
BITS: tuple[int | None, ...] = (None, 8, 4)


def _name(bits: int | None) -> str:
    return f"{bits}-bit" if bits else "full"


def demo_model(work: Path) -> Path:
    path = work / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", "--demo", str(path)], check=True)
    return path


def _greedy(engine: Any, rid: str, ids: list[int], n: int, seen: list[tuple[float, int]] | None = None) -> list[int]:
    """`n` greedy tokens of `ids` through the Engine; `seen` gets (the time, the tokens out so far) at each step that
    gave tokens."""
    from protocol.messages import Submit

    engine.submit(Submit(rid=rid, max_tokens=n, prompt_ids=ids, temperature=0.0))
    out: list[int] = []
    while len(engine):
        chunks, finished = engine.step()
        before = len(out)
        for chunk in chunks:
            out.extend(chunk[3])
        for f in finished:
            out.extend(f.token_ids)
        if seen is not None and len(out) > before:
            seen.append((time.perf_counter(), len(out)))
    return out


def quality(model: Path, text_tokens: int, chunk: int, n_cases: int | None = None) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.prompt_cache import CacheOptions
    from worker.mlx_engine.quantized_kv import quantize_cache

    reference = json.loads(FIXTURE.read_text())
    reference["cases"] = reference["cases"][:n_cases]
    greedy: dict[str, list[list[int]]] = {}
    for bits in BITS:
        engine = Engine(model, cache=CacheOptions(kv_bits=bits), warm="off")
        greedy[_name(bits)] = [_greedy(engine, f"c{i}", c["prompt_ids"], reference["max_tokens"])
                               for i, c in enumerate(reference["cases"])]
    eos = reference["eos_token_id"]
    recorded = [[t for t in c["tokens"] if t != eos] for c in reference["cases"]]
    cases = {name: {"same_as_full": sum(a == b for a, b in zip(runs, greedy["full"], strict=True)),
                    "same_as_recorded": sum(a == b for a, b in zip(runs, recorded, strict=True)),
                    "first_difference_from_full": [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                        None if len(a) == len(b) else min(len(a), len(b)))
                                                   for a, b in zip(runs, greedy["full"], strict=True)]}
             for name, runs in greedy.items()}

    text = subprocess.run(["git", "show", f"{TEXT_COMMIT}:docs/architecture.md"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    lm, tok = load(str(model))
    ids = tok.encode(text)[:text_tokens + 1]
    assert len(ids) == text_tokens + 1, f"the text has only {len(ids)} tokens"
    logprobs: dict[str, mx.array] = {}
    for bits in BITS:
        if "make_cache" in lm.__dict__:
            del lm.__dict__["make_cache"]
        quantize_cache(lm, bits)
        cache = make_prompt_cache(lm)
        parts = []
        for s in range(0, text_tokens, chunk):
            logits = lm(mx.array(ids[s:min(s + chunk, text_tokens)])[None], cache=cache)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = mx.array(ids[s + 1:min(s + chunk, text_tokens) + 1])
            parts.append(mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0])
            mx.eval(parts[-1], [c.state for c in cache])
        logprobs[_name(bits)] = mx.concatenate(parts)
    diffs = {}
    for name in ("8-bit", "4-bit"):
        d = mx.abs(logprobs[name] - logprobs["full"])
        diffs[name] = {"mean_abs": round(float(d.mean()), 5), "worst_abs": round(float(d.max()), 5),
                       "mean_logprob": round(float(logprobs[name].mean()), 5)}
    return {"model": str(model.name), "cases": len(reference["cases"]), "max_tokens": reference["max_tokens"],
            "greedy": cases, "text": {"file": f"docs/architecture.md@{TEXT_COMMIT}", "tokens": text_tokens,
                                      "chunk": chunk, "full_mean_logprob": round(float(logprobs["full"].mean()), 5),
                                      **diffs}}


def memory_model(work: Path, preset: str, dtype: str) -> Path:
    from worker.mlx_engine.make_model import FAMILIES, make_model

    path = work / f"llama-{preset}-kv64-{dtype}"
    if not (path / "config.json").exists():
        presets = FAMILIES["llama"].presets
        dims = presets[preset]
        presets["kv64"] = {**dims, "num_attention_heads": dims["hidden_size"] // 64,
                           "num_key_value_heads": dims["hidden_size"] // 64, "dtype": dtype,
                           "max_position_embeddings": 131072}
        try:
            make_model(path, "kv64", seed=0, arch="llama")
        finally:
            del presets["kv64"]
    return path


def memory_one(model: Path, bits: int | None, tokens: int, chunk: int) -> dict:
    """One bit width's prefill of `tokens` by the solo lane; run in a process of its own (its peak RSS is its own)."""
    import mlx.core as mx
    from mlx_lm import load

    from worker.mlx_engine.quantized_kv import quantize_cache
    from worker.mlx_engine.solo import Solo

    lm, _ = load(str(model))
    group = quantize_cache(lm, bits)
    mx.reset_peak_memory()
    ids = [(i * 7919) % 1000 + 3 for i in range(tokens + 1)]
    solo = Solo(lm, -1, ids, 0, None, max_tokens=1, sampler=None, eos=None)
    t0 = time.perf_counter()
    while not solo.step(chunk):
        pass
    seconds = time.perf_counter() - t0
    kv = sum(c.nbytes for c in solo.cache)
    return {"bits": bits, "group": group, "tokens": tokens, "kv_bytes": kv, "kv_bytes_per_token": kv / tokens,
            "mlx_peak_bytes": mx.get_peak_memory(), "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "prefill_s": round(seconds, 2), "cache": sorted({type(c).__name__ for c in solo.cache})}


def memory(work: Path, preset: str, dtype: str, tokens: int, chunk: int) -> dict:
    model = memory_model(work, preset, dtype)
    runs = {}
    for bits in BITS:
        out = subprocess.run([sys.executable, "-m", "bench.kv_quant", "--memory-one", str(bits or 0), "--model",
                              str(model), "--tokens", str(tokens), "--chunk", str(chunk)], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        runs[_name(bits)] = json.loads(out.strip().splitlines()[-1])
    full = runs["full"]
    for r in runs.values():
        r["kv_vs_full"] = round(r["kv_bytes"] / full["kv_bytes"], 4)
        r["mlx_peak_vs_full"] = round(r["mlx_peak_bytes"] / full["mlx_peak_bytes"], 4)
    return {"model": f"llama {preset} preset, head_dim 64, {dtype}", "chunk": chunk, "runs": runs}


def speed(work: Path, preset: str, dtype: str, short: int, decode: int, rounds: int) -> dict:
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.prompt_cache import CacheOptions

    model = memory_model(work, preset, dtype)
    engines = {_name(b): Engine(model, cache=CacheOptions(kv_bits=b), warm="off") for b in BITS}
    prompt = [(i * 31) % 900 + 5 for i in range(short)]
    for e in engines.values():  # a first request each: the compiled graph's first trace is not timed
        _greedy(e, "warm", prompt, 4)
    per: dict[str, list[float]] = {n: [] for n in engines}
    steps: dict[str, list[float]] = {n: [] for n in engines}  # decode alone: from the first token out to the last
    ttft: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            e, seen = engines[name], list[tuple[float, int]]()
            t0 = time.perf_counter()
            out = _greedy(e, f"r{r}", prompt, decode, seen)
            per[name].append(len(out) / (time.perf_counter() - t0))
            ttft[name].append(seen[0][0] - t0)
            steps[name].append((seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0]))
    return {"model": f"llama {preset} preset, head_dim 64, {dtype}", "prompt_tokens": short, "decode_tokens": decode,
            "rounds": rounds, "tok_s_median": {n: round(statistics.median(v), 2) for n, v in per.items()},
            "ratio_to_full": _ratios(per),
            "decode_tok_s_median": {n: round(statistics.median(v), 2) for n, v in steps.items()},
            "decode_ratio_to_full": _ratios(steps),
            "ttft_s_median": {n: round(statistics.median(v), 3) for n, v in ttft.items()},
            "compiled_decode": {n: e.graph is not None for n, e in engines.items()}}


def _ratios(per: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each side's per-round ratio to full precision: the median, the least and the most."""
    ratios = {n: [a / b for a, b in zip(per[n], per["full"], strict=True)] for n in per if n != "full"}
    return {n: {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4)}
            for n, v in ratios.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="quality,memory,speed")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/mlxsup-bench-kv"))
    p.add_argument("--demo-model", type=Path, default=None, help="an imported SmolLM2 (default: imported into --work)")
    p.add_argument("--text-tokens", type=int, default=2048)
    p.add_argument("--cases", type=int, default=None, help="quality: the first N recorded prompts (default: all)")
    p.add_argument("--tokens", type=int, default=16384, help="memory: the prompt's tokens")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens a step)")
    p.add_argument("--memory-preset", default="tiny", help="memory and speed: the llama preset (head_dim set to 64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="memory and speed: the model's dtype (float32: the CPU's own; MLX's CPU float16 kernels are"
                        " slow enough to swamp what is measured)")
    p.add_argument("--speed-presets", default="tiny,small", help="speed: the llama presets timed, one after another")
    p.add_argument("--short", type=int, default=128)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory-one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_one is not None:
        print(json.dumps(memory_one(args.model, args.memory_one or None, args.tokens, args.chunk)))
        return
    import mlx.core as mx

    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": str(mx.default_device()), "command": " ".join(["python -m bench.kv_quant",
                                                                                        *(argv or sys.argv[1:])])}
    for section in args.sections.split(","):
        t0 = time.perf_counter()
        if section == "quality":
            result[section] = quality(args.demo_model or demo_model(args.work), args.text_tokens, args.chunk,
                                      args.cases)
        elif section == "memory":
            result[section] = memory(args.work, args.memory_preset, args.dtype, args.tokens, args.chunk)
        elif section == "speed":
            result[section] = {preset: speed(args.work, preset, args.dtype, args.short, args.decode, args.rounds)
                               for preset in args.speed_presets.split(",")}
        else:
            p.error(f"unknown section {section}")
        result[section]["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({section: result[section]}, indent=1), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
