"""Constrained decoding's cost per token, in process, on the worker's own engine.

    python -m bench.constrained --out bench/results/cpu/constrained          # ~3 min on the 2-core CPU box
    python -m bench.constrained --preset tiny --steps 20 --out /tmp/c        # smoke

Two parts, both written to results.json and results.md under --out:
1. engine: step time of the worker's Engine (BatchGenerator + the per-request llguidance logits processor)
   with 1 stream and with 32, every stream plain, one constrained among plain ones, every stream
   constrained (`response_format` json_schema). The cost per token of a constrained stream is its step time
   less the plain batch's; what one constrained stream costs the 31 plain ones beside it is the same
   difference seen from their side (they wait for the same step).
2. candidates: the grammar libraries alone on the model's tokenizer, one JSON schema, a random walk of
   allowed tokens: time to compile, time per token (mask + advance). llguidance and outlines-core; xgrammar
   is recorded as not installable here (its wheels require torch).

Each step's time is the median over `--steps` steps once every stream is decoding (the prefill is excluded);
each configuration runs `--rounds` times, in order and then reversed, and the median run is reported.
A constrained stream whose JSON closes leaves the batch: the table says how many streams each median saw.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from protocol.messages import Submit

SCHEMA = {"type": "object", "required": ["title", "notes"], "additionalProperties": False,
          "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}}}
JSON_CONSTRAINT = {"type": "json", "schema": SCHEMA, "name": "bench"}


def _submit(i: int, constrained: bool, max_tokens: int) -> Submit:
    return Submit(rid=f"r{i}", max_tokens=max_tokens, messages=[{"role": "user", "content": f"Write a note {i}."}],
                  temperature=0.0, constraint=JSON_CONSTRAINT if constrained else None, ignore_eos=not constrained)


def run_engine(engine, plain: int, constrained: int, steps: int) -> dict:
    """Median step time with `plain` + `constrained` streams, once all of them decode."""
    total = plain + constrained
    for i in range(total):
        engine.submit(_submit(i, i >= plain, steps * 4))
    times, sizes = [], []
    while len(engine) and len(times) < steps:
        decoding = engine.batch_size()
        engine.plan_step()
        t0 = time.perf_counter()
        engine.step()
        if decoding == len(engine) and engine.waiting() == 0 and decoding > 0:
            times.append(time.perf_counter() - t0)
            sizes.append(decoding)
    for rid in list(engine.rids):
        engine.abort(rid)
    print(f"[constrained] plain={plain} constrained={constrained} steps={len(times)} "
          f"median_ms={statistics.median(times) * 1000 if times else float('nan'):.2f}", flush=True)
    median = statistics.median(times) if times else float("nan")
    return {"plain": plain, "constrained": constrained, "steps": len(times), "step_ms": round(median * 1000, 3),
            "streams_seen": [min(sizes, default=0), max(sizes, default=0)],
            "tok_s": round(statistics.median(sizes) / median, 1) if times else None}


CONFIGS = [(1, 0), (0, 1), (32, 0), (31, 1), (0, 32)]


def engine_part(model: Path, steps: int, rounds: int) -> dict:
    """Each configuration `rounds` times, in order then reversed (a shared machine's drift hits all alike)."""
    from worker.mlx_engine.engine import Engine

    engine = Engine(model, max_batch_size=32, prefill_batch_size=32)
    assert engine.grammars.tokenizer is not None  # built before any timing (once per model, at the first constrained request)
    run_engine(engine, 32, 1, 4)  # warm-up: the batch shapes' first kernels are not what is measured
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            runs[config].append(run_engine(engine, *config, steps))
    rows = []
    for config in CONFIGS:
        best = sorted(runs[config], key=lambda row: row["step_ms"])[len(runs[config]) // 2]  # the median run
        rows.append({**best, "rounds_step_ms": [row["step_ms"] for row in runs[config]]})
    def paired(a: tuple[int, int], b: tuple[int, int], per: int = 1) -> float:
        """Median over rounds of a's step time less b's in the same round (a shared machine drifts between rounds)."""
        return round(statistics.median((x["step_ms"] - y["step_ms"]) / per for x, y in zip(runs[a], runs[b])), 3)

    return {"rows": rows, "vocab": engine.vocab_size, "rounds": rounds,
            "cost_per_token_ms_1_stream": paired((0, 1), (1, 0)),
            "cost_to_31_plain_ms_per_token": paired((31, 1), (32, 0)),
            "cost_per_token_ms_32_constrained": paired((0, 32), (32, 0), 32)}


def _walk(allowed_next, advance, tokens: int, rng: np.random.Generator) -> int:
    n = 0
    for _ in range(tokens):
        ids = allowed_next()
        if len(ids) == 0:
            break
        if not advance(int(rng.choice(ids))):
            break
        n += 1
    return n


def candidates_part(model: Path, tokens: int) -> dict:
    from mlx_lm import load

    _, tok = load(str(model))
    out: dict = {"xgrammar": {"installed": False, "why": "its wheels require torch (and apache-tvm-ffi)"}}
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok._tokenizer, eos_token=sorted(tok.eos_token_ids))
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t_compile = time.perf_counter() - t0
    bitmask = lnp.allocate_token_bitmask(1, ltok.vocab_size)

    def llg_allowed() -> np.ndarray:
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        return np.nonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: ltok.vocab_size])[0]

    t0 = time.perf_counter()
    n = _walk(llg_allowed, lambda t: matcher.consume_token(t) and not matcher.is_stopped(), tokens,
              np.random.default_rng(0))
    out["llguidance"] = {"installed": True, "tokenizer_s": round(t_tok, 4), "compile_s": round(t_compile, 4),
                         "tokens": n, "us_per_token": round((time.perf_counter() - t0) / max(n, 1) * 1e6, 1)}
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        out["outlines_core"] = {"installed": False}
        return out
    eos = min(tok.eos_token_ids)
    by_text: dict[str, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i not in tok.eos_token_ids:
            by_text.setdefault(tok.convert_tokens_to_string([text]), []).append(i)
    t0 = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(eos, {k: v for k, v in by_text.items() if k})
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    t_compile = time.perf_counter() - t0
    guide = outlines_core.Guide(index)

    def oc_advance(t: int) -> bool:
        guide.advance(t)
        return not guide.is_finished()

    t0 = time.perf_counter()
    n = _walk(lambda: np.array(guide.get_tokens()), oc_advance, tokens, np.random.default_rng(0))
    out["outlines_core"] = {"installed": True, "compile_s": round(t_compile, 4), "tokens": n,
                            "us_per_token": round((time.perf_counter() - t0) / max(n, 1) * 1e6, 1)}
    return out


def render(results: dict) -> str:
    e, c = results["engine"], results["candidates"]
    lines = ["# Constrained decoding: cost per token", "", f"`{results['command']}` on {results['machine']}, "
             f"model {results['model']} (vocab {e['vocab']}), greedy, median step time once every stream decodes; "
             f"{e['rounds']} rounds, the median run shown, every round's in the last column.", "",
             "| streams (plain + constrained) | step ms | streams in the steps | tok/s | step ms, each round |",
             "| --- | --- | --- | --- | --- |"]
    for r in e["rows"]:
        lines.append(f"| {r['plain']} + {r['constrained']} | {r['step_ms']} | {r['streams_seen'][0]}-"
                     f"{r['streams_seen'][1]} | {r['tok_s']} | {', '.join(map(str, r['rounds_step_ms']))} |")
    lines += ["", "Costs: the median over rounds of the difference within a round.", "",
              f"- one constrained stream alone: **{e['cost_per_token_ms_1_stream']} ms** more per token than a "
              "plain one", f"- one constrained stream among 31 plain: each step (so each plain stream's token) "
              f"**{e['cost_to_31_plain_ms_per_token']} ms** slower", f"- 32 constrained: "
              f"**{e['cost_per_token_ms_32_constrained']} ms** per constrained token over the plain batch", "",
              "## The grammar libraries alone (same tokenizer, same schema, random walk of allowed tokens)", "",
              "| library | installed | compile s | µs per token (mask + advance) |", "| --- | --- | --- | --- |"]
    for name in ("llguidance", "outlines_core", "xgrammar"):
        row = c.get(name, {})
        lines.append(f"| {name} | {row.get('installed')} {row.get('why', '')} | {row.get('compile_s', '-')} | "
                     f"{row.get('us_per_token', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.constrained")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="a make-model folder (default: make one, qwen3 --preset small)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--walk", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from worker.mlx_engine.make_model import make_model

        model = Path(tempfile.mkdtemp(prefix="mlxsup-constrained-")) / "model"  # never beside the results
        make_model(model, args.preset, seed=0, arch="qwen3")
    results = {"command": "python -m bench.constrained " + " ".join(sys.argv[1:] if argv is None else argv), "machine": platform.platform(),
               "model": f"qwen3 {args.preset}" if args.model is None else str(model),
               "engine": engine_part(model, args.steps, args.rounds), "candidates": candidates_part(model, args.walk)}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
