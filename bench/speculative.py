"""Single-stream decoding with speculative decoding on and off (issue 30), in one process on the worker's Engine.

    python -m bench.speculative --demo --out F.json                # SmolLM2-135M-Instruct (serve --demo's import)
    python -m bench.speculative --model DIR --modes off,prompt-lookup,draft --draft DIR --out F.json
    python -m bench.speculative --model DIR --oracle 1-16 --out F.json          # the ceiling: the oracle's curve

A code-editing request (the model is shown a code block and asked to give it back with one name changed, as a
coding agent's edit asks), greedy, one stream, on the product's Engine driven by submit/step (no sockets: the
mechanism's own speed). Each round runs every mode once, in an order reversed every other round; per mode: the
time per generated token after the first (decode ms/token: drafting emits tokens in bursts, so the mean over
the stream is what a client waits, not the median gap), TTFT, and drafted / accepted tokens. Ratios are medians
of per-round ratios against `off`, with their spread. `parity` says every mode gave the same ids (it must).

`--oracle K1-K2` measures the mechanism's ceiling instead (issue 30): a plain run records the target's greedy
output, and the oracle (speculative.py's `Oracle`) proposes it back at each draft length, so every draft is kept
and drafting costs nothing. Each round runs plain and every length once (the order reversed every other round),
EOS ignored (random weights end early); per length: tokens/s and decode ms/token (median over rounds, with the
spread), the median ITL (a step's gap shared by the tokens it emitted), the per-round ratio to plain, and what
draft_pricing.py measures for it (a plain step, a verification of k + 1 tokens, the break-even acceptance).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import median

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; the result is sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The length covered by the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


def gaps(intervals, lo, hi):
    """The parts of [lo, hi] that no interval covers."""
    out, cursor = [], lo
    for start, end in merge_intervals(intervals):
        if start > cursor:
            out.append([cursor, min(start, hi)])
        cursor = max(cursor, end)
    if cursor < hi:
        out.append([cursor, hi])
    return out
'''
ASK = ("Here is a Python module:\n\n```python\n" + CODE + "```\n\nRename `merge_intervals` to `merge_spans` "
       "everywhere and give back the whole module, unchanged otherwise, in one code block.")


def demo_model(work: Path) -> Path:
    path = work / "smollm2"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", "--demo", str(path)], check=True)
    return path


def one(engine: object, msg: object) -> dict:
    """One request to its end: decode ms/token after the first, TTFT, median ITL, its ids and its draft counts."""
    t0 = time.perf_counter()
    engine.submit(msg)  # type: ignore[attr-defined]
    ids: list[int] = []
    first = last = None
    fin = None
    itl: list[float] = []  # per token after the first: its step's gap over the tokens that step emitted
    while len(engine):  # type: ignore[arg-type]
        chunks, finished = engine.step()  # type: ignore[attr-defined]
        got = [i for c in chunks for i in c[3]] + [i for f in finished for i in f.token_ids]
        if got:
            now = time.perf_counter()
            if last is not None:
                itl += [(now - last) * 1e3 / len(got)] * len(got)
            last = now
            first = first if first is not None else last
            ids += got
        fin = finished[0] if finished else fin
    n = len(ids)
    return {"tokens": n, "ttft_ms": (first - t0) * 1e3 if first else None, "itl_p50_ms": median(itl),
            "decode_ms_per_token": (last - first) / (n - 1) * 1e3 if first and last and n > 1 else None,
            "drafted": fin.drafted_tokens if fin else 0, "accepted": fin.accepted_tokens if fin else 0, "ids": ids}


def lengths(spec: str) -> list[int]:
    """"1-16" or "1,2,4,8": draft lengths."""
    if "-" in spec:
        lo, hi = spec.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(k) for k in spec.split(",")]


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 4), round(max(values), 4)]


def oracle_sweep(engine: object, msg: object, ks: list[int], rounds: int) -> dict:
    """Plain decoding and the oracle at each draft length, interleaved over rounds: the mechanism's ceiling."""
    from worker.mlx_engine.draft_pricing import measure
    from worker.mlx_engine.speculative import Speculation

    plain = engine.speculation  # type: ignore[attr-defined]
    record = one(engine, msg)["ids"]  # also the warm-up: first kernels, the decode graph's first trace
    sequence = engine.tokenize(msg) + record  # type: ignore[attr-defined]
    specs = {"off": plain} | {k: Speculation("oracle", k, oracle=sequence) for k in ks}
    for k in ks:  # a verification's first trace at each length, out of the timed rounds
        engine.speculation = specs[k]  # type: ignore[attr-defined]
        one(engine, msg)
    runs: list[dict] = []
    for r in range(rounds):
        order = list(specs) if r % 2 == 0 else list(specs)[::-1]
        runs.append({})
        for name in order:
            engine.speculation = specs[name]  # type: ignore[attr-defined]
            runs[-1][name] = one(engine, msg)
        print(json.dumps({str(n): round(x["decode_ms_per_token"], 3) for n, x in runs[-1].items()}), flush=True)
    engine.speculation = plain  # type: ignore[attr-defined]
    curve: dict[str, dict] = {}
    for name in specs:
        ms = [x[name]["decode_ms_per_token"] for x in runs]
        tps = [1e3 / v for v in ms]
        ratios = [x["off"]["decode_ms_per_token"] / x[name]["decode_ms_per_token"] for x in runs]
        last = runs[-1][name]
        curve[str(name)] = {"decode_ms_per_token_p50": median(ms), "decode_ms_spread": spread(ms),
                            "tokens_per_s_p50": median(tps), "tokens_per_s_spread": spread(tps),
                            "itl_p50_ms": median([x[name]["itl_p50_ms"] for x in runs]),
                            "speedup_vs_off_p50": median(ratios), "speedup_spread": spread(ratios),
                            "drafted": last["drafted"], "accepted": last["accepted"]}
        if name != "off":
            c = measure(engine.model, engine.graph, int(name), None)  # type: ignore[attr-defined]
            curve[str(name)]["priced"] = {"plain_ms": round(c.plain_s * 1e3, 4), "verify_ms": round(c.verify_s * 1e3, 4),
                                          "break_even": round(c.break_even(c.k), 3)}
    parity = all(x[name]["ids"] == record for x in runs for name in specs)
    accepted_all = all(x[k]["drafted"] == x[k]["accepted"] > 0 for x in runs for k in ks)
    best = max(ks, key=lambda k: curve[str(k)]["speedup_vs_off_p50"] or 0)
    return {"curve": curve, "parity": parity, "every_draft_kept": accepted_all, "best_k": best,
            "best_speedup_p50": curve[str(best)]["speedup_vs_off_p50"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative")
    p.add_argument("--model", type=Path)
    p.add_argument("--demo", action="store_true", help="SmolLM2-135M-Instruct, imported as `serve --demo` does")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mlxsup-bench-spec")
    p.add_argument("--modes", default="off,prompt-lookup")
    p.add_argument("--draft", type=Path, default=None, help="the draft model, for the `draft` mode")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--solo", default="auto", help="the worker's --solo mode")
    p.add_argument("--oracle", default=None, metavar="KS",
                   help="the oracle's sweep over draft lengths (\"1-16\" or \"1,4,8\") instead of --modes")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.model is None and not args.demo:
        p.error("--model DIR or --demo")
    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine

    model = args.model or demo_model(args.work)
    if args.oracle is not None:
        engine = Engine(model, solo=args.solo)
        ask = Submit(rid="r", max_tokens=args.tokens, messages=[{"role": "user", "content": ASK}], temperature=0.0,
                     ignore_eos=True)
        sweep = oracle_sweep(engine, ask, lengths(args.oracle), args.rounds)
        result = {"model": str(model), "solo": args.solo, "graph": engine.graph is not None, "rounds": args.rounds,
                  "tokens": args.tokens} | sweep
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return 0 if sweep["parity"] and sweep["every_draft_kept"] else 1
    modes = args.modes.split(",")
    engines = {m: Engine(model, solo=args.solo, speculative=m, draft=args.draft if m == "draft" else None,
                         num_draft_tokens=args.num_draft_tokens) for m in modes}
    msg = Submit(rid="r", max_tokens=args.tokens, messages=[{"role": "user", "content": ASK}], temperature=0.0)
    for engine in engines.values():
        one(engine, msg)  # warm: first kernels, the decode graph's first trace
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        rounds.append({m: one(engines[m], msg) for m in order})
        print(json.dumps({m: {k: v for k, v in x.items() if k != "ids"} for m, x in rounds[-1].items()}), flush=True)
    summary: dict[str, dict] = {}
    for m in modes:
        per_token = [x[m]["decode_ms_per_token"] for x in rounds]
        ratios = [x["off"]["decode_ms_per_token"] / x[m]["decode_ms_per_token"] for x in rounds if "off" in x]
        summary[m] = {"decode_ms_per_token_p50": median(per_token), "spread": [min(per_token), max(per_token)],
                      "ttft_ms_p50": median([x[m]["ttft_ms"] for x in rounds]),
                      "speedup_vs_off_p50": median(ratios), "speedup_spread": [min(ratios), max(ratios)] if ratios else None,
                      "drafted": rounds[-1][m]["drafted"], "accepted": rounds[-1][m]["accepted"],
                      "tokens": rounds[-1][m]["tokens"]}
    parity = all(x[m]["ids"] == rounds[0][modes[0]]["ids"] for x in rounds for m in modes)
    result = {"model": str(model), "modes": modes, "num_draft_tokens": args.num_draft_tokens, "rounds": args.rounds,
              "tokens": args.tokens, "parity": parity, "summary": summary,
              "text": engines[modes[0]].tokenizer.decode(rounds[0][modes[0]]["ids"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"parity": parity, "summary": summary}, indent=2))
    return 0 if parity else 1


if __name__ == "__main__":
    sys.exit(main())
