"""Single-stream decoding with speculative decoding on and off, in one process on the worker's Engine.

    python -m bench.speculative --demo --out F.json                # SmolLM2-135M-Instruct (serve --demo's import)
    python -m bench.speculative --model DIR --modes off,prompt-lookup,draft [--draft DIR] --out F.json
    python -m bench.speculative --model DIR --oracle 1-16 --out F.json          # the ceiling: the oracle's curve
    python -m bench.speculative --model DIR --oracle 1-8 --streams 4 --out F.json  # ... of 4 streams drafting together
    python -m bench.speculative --model DIR --oracle 4 --streams 8 --wrong 7 --out F.json  # rows keeping their own counts
    python -m bench.speculative --model DIR --oracle 1-8 --mtp --out F.json   # an MTP head's forced-acceptance ceiling
    python -m bench.speculative --model DIR --oracle 1-7 --dflash DRAFTER --out F.json  # ... a DFlash drafter's

A code-editing request (the model is shown a code block and asked to give it back with one name changed, as a
coding agent's edit asks), greedy, one stream, on the product's Engine driven by submit/step (no sockets: the
mechanism's own speed). Each round runs every mode once, in an order reversed every other round; per mode: the
time per generated token after the first (decode ms/token: drafting emits tokens in bursts, so the mean over
the stream is what a client waits, not the median gap), TTFT, and drafted / accepted tokens. Ratios are medians
of per-round ratios against `off`, with their spread. `parity` says every mode gave the same ids (it must). Per
drafting mode also the acceptance rate (kept / drafted over every round) and what drafting costs here
(draft_pricing.py: a plain step, a verification of k + 1 tokens, a draft model's step, the break-even).
Without `--draft`, the draft mode's model is made here: `make-model --draft-for MODEL --preset DRAFT_PRESET`
(a smaller model with the target's tokenizer; random weights, so it accepts almost nothing).

`--oracle K1-K2` measures the mechanism's ceiling instead: a plain run records the target's greedy
output, and the oracle (speculative.py's `Oracle`) proposes it back at each draft length, so every draft is kept
and drafting costs nothing. Each round runs plain and every length once (the order reversed every other round),
EOS ignored (random weights end early); per length: tokens/s and decode ms/token (median over rounds, with the
spread), the median ITL (a step's gap shared by the tokens it emitted), the per-round ratio to plain, and what
draft_pricing.py measures for it (a plain step, a verification of k + 1 tokens, the break-even acceptance). With
`--streams N`, N identical requests decode together, drafting in lockstep in the batch (batch_drafting.py); a stream's
ms/token is then the time per step, and the costs are measured at N rows. With `--mtp` (a model with an MTP head:
`make-model --arch qwen3_5 --mtp`), each length's drafts are the head's, paid in full (its step per draft, its
pairing of each kept token's hidden state), with the record proposed in their place (speculative.py's `Forced`):
the head's ceiling with every draft kept, its draft step priced beside the verification. `--dflash DRAFTER` (a
DFlash drafter: `make-model DRAFTER --dflash-for DIR`) the same for its blocks (k at most its block size - 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median

ROOT = Path(__file__).resolve().parent.parent

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


def made_draft(model: Path, preset: str, work: Path) -> Path:
    """A draft model for `model` (make-model --draft-for), made once per target tokenizer and preset."""
    path = work / f"draft-{preset}-for-{model.name}"
    same = (path / "config.json").is_file() and (path / "tokenizer.json").read_bytes() == (
        model / "tokenizer.json").read_bytes()
    if not same:
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", str(path), "--preset", preset,
                        "--draft-for", str(model)], check=True, cwd=ROOT)
    return path


def priced(engine: object) -> dict | None:
    """What drafting costs on this machine, as the engine measured it (None: it never priced a draft)."""
    costs = engine.speculation.pricing.costs  # type: ignore[attr-defined]
    if costs is None:
        return None
    return {"plain_ms": round(costs.plain_s * 1e3, 4), "verify_ms": round(costs.verify_s * 1e3, 4),
            "draft_ms": round(costs.draft_s * 1e3, 4), "break_even": round(costs.break_even(costs.k), 3)}


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


def many(engine: object, msg: Any, streams: int, records: list[list[int]] | None = None) -> dict:
    """`streams` copies of `msg` decoding together (batch drafting: batch_drafting.py), as `one` reports one: the time
    per step after the first token (a stream's ms/token), drafts summed; `ids`: the streams' own, where all agree.
    `records`: with the oracle, each stream's own record to propose (its drafter replaced once all are in)."""
    from dataclasses import replace

    from worker.mlx_engine.speculative import Oracle

    t0 = time.perf_counter()
    for i in range(streams):
        engine.submit(replace(msg, rid=f"r{i}"))  # type: ignore[attr-defined]
    if records is not None and engine.speculation.mode == "oracle":  # type: ignore[attr-defined]
        for i, record in enumerate(records):
            row = engine.batch_drafts.rows.get(engine._by_rid[f"r{i}"].uid)  # type: ignore[attr-defined]
            if row is not None:
                row.drafter = Oracle(record)
    ids: dict[str, list[int]] = {}
    first = last = None
    drafted = accepted = 0
    while len(engine):  # type: ignore[arg-type]
        chunks, finished = engine.step()  # type: ignore[attr-defined]
        for rid, got in [(c[0], c[3]) for c in chunks] + [(f.rid, f.token_ids) for f in finished]:
            ids.setdefault(rid, []).extend(got)
        drafted += sum(f.drafted_tokens for f in finished)
        accepted += sum(f.accepted_tokens for f in finished)
        if chunks or finished:
            last = time.perf_counter()
            first = first if first is not None else last
    n = max(map(len, ids.values()))
    same = all(v == ids["r0"] for v in ids.values())
    return {"tokens": n, "ttft_ms": (first - t0) * 1e3 if first else None, "itl_p50_ms": None,
            "decode_ms_per_token": (last - first) / (n - 1) * 1e3 if first and last and n > 1 else None,
            "drafted": drafted, "accepted": accepted, "ids": ids["r0"] if same else []}


def lengths(spec: str) -> list[int]:
    """"1-16" or "1,2,4,8": draft lengths."""
    if "-" in spec:
        lo, hi = spec.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(k) for k in spec.split(",")]


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 4), round(max(values), 4)]


def acceptance(runs: list[dict]) -> float | None:
    """Drafts kept over drafts proposed, over every run (None: nothing drafted)."""
    drafted = sum(x["drafted"] for x in runs)
    return round(sum(x["accepted"] for x in runs) / drafted, 4) if drafted else None


def markdown(result: dict) -> str:
    """The result as a short table: per mode (or draft length), speed, its ratio to plain with spread, drafts."""
    def num(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    head = (f"`{result['command']}`  \nmlxsup {result['commit']}, {result['rounds']} interleaved rounds, "
            f"{result['tokens']} tokens, greedy; parity (every mode's ids equal): {result['parity']}\n\n")
    rows = result.get("summary") or result.get("curve") or {}
    lines = ["| mode (oracle: k) | decode ms/token p50 [spread] | tokens/s over plain p50 [spread] | drafted / accepted "
             "(last round) | acceptance | plain / verify / draft ms, break-even |", "|---|---|---|---|---|---|"]
    for name, x in rows.items():
        ms_spread = x.get("spread") or x.get("decode_ms_spread") or [None, None]
        ratio = x.get("speedup_spread") or [None, None]
        cost = x.get("priced")
        costs = "-" if not cost else (f"{num(cost['plain_ms'])} / {num(cost['verify_ms'])} / "
                                      f"{num(cost.get('draft_ms', 0.0))}, {num(cost['break_even'], 2)}")
        lines.append(f"| {name} | {num(x['decode_ms_per_token_p50'], 2)} [{num(ms_spread[0], 2)}-{num(ms_spread[1], 2)}]"
                     f" | {num(x['speedup_vs_off_p50'])} [{num(ratio[0])}-{num(ratio[1])}] | {x['drafted']} / "
                     f"{x['accepted']} | {num(x.get('acceptance'))} | {costs} |")
    return head + "\n".join(lines) + "\n"


def write(out: Path, result: dict) -> None:
    """result as JSON at `out` and as markdown beside it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result = {"command": " ".join(["python -m bench.speculative", *sys.argv[1:]]),
              "commit": commit.stdout.strip()} | result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))


def oracle_sweep(engine: object, msg: object, ks: list[int], rounds: int, streams: int = 1, wrong: int = 0,
                 tapped: str | None = None) -> dict:
    """Plain decoding and the oracle at each draft length, interleaved over rounds: the mechanism's ceiling; with
    `streams` > 1, that many identical streams drafting together in the batch. `wrong`: stream i's record has every
    `wrong`-th generated token changed, at offset i, so the rows reject drafts at different places and each keeps
    its own count (the ids stay plain decoding's)."""
    from worker.mlx_engine.dflash import DFlashStep
    from worker.mlx_engine.draft_pricing import measure
    from worker.mlx_engine.mtp import HeadStep, MTPHead
    from worker.mlx_engine.speculative import Speculation

    records: list[list[int]] | None = None

    def run(msg: object) -> dict:
        return one(engine, msg) if streams == 1 else many(engine, msg, streams, records)

    plain = engine.speculation  # type: ignore[attr-defined]
    record = run(msg)["ids"]  # also the warm-up: first kernels, the decode graph's first trace
    sequence = engine.tokenize(msg) + record  # type: ignore[attr-defined]
    if wrong:
        start = len(sequence) - len(record)
        records = [[t + 1 if j > start and (j + i) % wrong == 0 else t for j, t in enumerate(sequence)]
                   for i in range(streams)]
    head = plain.head if tapped else None  # the MTP head or DFlash drafter the engine loaded
    if tapped and head is None:
        raise SystemExit(f"--{tapped}: the engine loaded no such drafter")
    specs = {"off": Speculation("off") if tapped else plain} | {
        k: Speculation(tapped or "oracle", k, oracle=sequence, head=head) for k in ks}
    for k in ks:  # a verification's first trace at each length, out of the timed rounds
        engine.speculation = specs[k]  # type: ignore[attr-defined]
        run(msg)
    runs: list[dict] = []
    for r in range(rounds):
        order = list(specs) if r % 2 == 0 else list(specs)[::-1]
        runs.append({})
        for name in order:
            engine.speculation = specs[name]  # type: ignore[attr-defined]
            runs[-1][name] = run(msg)
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
                            "itl_p50_ms": median([x[name]["itl_p50_ms"] for x in runs]) if streams == 1 else None,
                            "speedup_vs_off_p50": median(ratios), "speedup_spread": spread(ratios),
                            "drafted": last["drafted"], "accepted": last["accepted"],
                            "acceptance": acceptance([x[name] for x in runs])}
        if name != "off":
            c = measure(engine.model, engine.graph if streams == 1 else None,  # type: ignore[attr-defined]
                        int(name), None if head is None else HeadStep(head) if isinstance(head, MTPHead)
                        else DFlashStep(head), streams)
            curve[str(name)]["priced"] = {"plain_ms": round(c.plain_s * 1e3, 4), "verify_ms": round(c.verify_s * 1e3, 4),
                                          "draft_ms": round(c.draft_s * 1e3, 4), "break_even": round(c.break_even(c.k), 3)}
    parity = all(x[name]["ids"] == record for x in runs for name in specs)
    accepted_all = all(x[k]["drafted"] == x[k]["accepted"] > 0 for x in runs for k in ks) if not wrong else None
    best = max(ks, key=lambda k: curve[str(k)]["speedup_vs_off_p50"] or 0)
    return {"curve": curve, "parity": parity, "every_draft_kept": accepted_all, "best_k": best,
            "best_speedup_p50": curve[str(best)]["speedup_vs_off_p50"]}


def modes_compare(engines: dict[str, Any], msg: object, rounds: int) -> dict:
    """Every mode's engine on `msg`, interleaved over rounds (after one warm run each): per mode its speed, the
    per-round ratio to `off` with its spread, drafts, acceptance and costs; `parity`: every run gave the same ids."""
    modes = list(engines)
    for engine in engines.values():
        one(engine, msg)  # warm: first kernels, the decode graph's first trace
    runs: list[dict[str, dict]] = []
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        runs.append({m: one(engines[m], msg) for m in order})
        print(json.dumps({m: {k: v for k, v in x.items() if k != "ids"} for m, x in runs[-1].items()}), flush=True)
    summary: dict[str, dict] = {}
    for m in modes:
        per_token = [x[m]["decode_ms_per_token"] for x in runs]
        ratios = [x["off"]["decode_ms_per_token"] / x[m]["decode_ms_per_token"] for x in runs if "off" in x]
        summary[m] = {"decode_ms_per_token_p50": median(per_token), "spread": spread(per_token),
                      "ttft_ms_p50": median([x[m]["ttft_ms"] for x in runs]),
                      "speedup_vs_off_p50": median(ratios), "speedup_spread": spread(ratios) if ratios else None,
                      "drafted": runs[-1][m]["drafted"], "accepted": runs[-1][m]["accepted"],
                      "acceptance": acceptance([x[m] for x in runs]), "priced": priced(engines[m]),
                      "tokens": runs[-1][m]["tokens"]}
    first = runs[0][modes[0]]["ids"]
    return {"parity": all(x[m]["ids"] == first for x in runs for m in modes), "summary": summary,
            "runs": [{m: {k: v for k, v in x.items() if k != "ids"} for m, x in r.items()} for r in runs],
            "text": engines[modes[0]].tokenizer.decode(first)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative")
    p.add_argument("--model", type=Path)
    p.add_argument("--demo", action="store_true", help="SmolLM2-135M-Instruct, imported as `serve --demo` does")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mlxsup-bench-spec")
    p.add_argument("--modes", default="off,prompt-lookup")
    p.add_argument("--draft", type=Path, default=None,
                   help="the draft model, for the `draft` mode (default: made for --model at --draft-preset)")
    p.add_argument("--draft-preset", default="tiny", help="the made draft model's preset (make-model --draft-for)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--solo", default="auto", help="the worker's --solo mode")
    p.add_argument("--oracle", default=None, metavar="KS",
                   help="the oracle's sweep over draft lengths (\"1-16\" or \"1,4,8\") instead of --modes")
    p.add_argument("--streams", type=int, default=1,
                   help="--oracle with this many identical streams decoding (and drafting) together in the batch")
    p.add_argument("--wrong", type=int, default=0, metavar="N",
                   help="--oracle --streams: each stream's record wrong at every N-th token, at its own offset")
    p.add_argument("--mtp", action="store_true",
                   help="--oracle: the model's MTP head drafts at each length, paid in full, the record proposed instead")
    p.add_argument("--dflash", type=Path, default=None, metavar="DRAFTER",
                   help="--oracle: this DFlash drafter drafts at each length, paid in full, the record proposed instead")
    p.add_argument("--hot-cache", type=int, default=0, metavar="BYTES",
                   help="the engines' hot prompt cache (0: none): every run after a mode's first reads the prompt "
                        "from it, where a CPU would prefill it for longer than it decodes (ids and decode unchanged)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.model is None and not args.demo:
        p.error("--model DIR or --demo")
    from protocol.messages import Submit
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.prompt_cache import CacheOptions

    cache = CacheOptions(hot_bytes=args.hot_cache) if args.hot_cache else None

    model = args.model or demo_model(args.work)
    if args.oracle is not None:
        tapped = "mtp" if args.mtp else "dflash" if args.dflash else None
        engine = Engine(model, solo=args.solo, cache=cache, speculative=tapped or "off", draft=args.dflash)
        ask = Submit(rid="r", max_tokens=args.tokens, messages=[{"role": "user", "content": ASK}], temperature=0.0,
                     ignore_eos=True)
        sweep = oracle_sweep(engine, ask, lengths(args.oracle), args.rounds, args.streams, args.wrong, tapped)
        result = {"model": str(model), "solo": args.solo, "hot_cache": args.hot_cache, "streams": args.streams,
                  "drafter": tapped, "dflash": str(args.dflash) if args.dflash else None,
                  "wrong": args.wrong,
                  "graph": engine.graph is not None, "rounds": args.rounds, "tokens": args.tokens} | sweep
        write(args.out, result)
        print(json.dumps(result, indent=2))
        return 0 if sweep["parity"] and sweep["every_draft_kept"] is not False else 1
    modes = args.modes.split(",")
    if "draft" in modes and args.draft is None:
        args.draft = made_draft(model, args.draft_preset, args.work)
    engines = {m: Engine(model, solo=args.solo, cache=cache, speculative=m,
                         draft=args.draft if m == "draft" else None, num_draft_tokens=args.num_draft_tokens)
               for m in modes}
    msg = Submit(rid="r", max_tokens=args.tokens, messages=[{"role": "user", "content": ASK}], temperature=0.0)
    compared = modes_compare(engines, msg, args.rounds)
    result = {"model": str(model), "hot_cache": args.hot_cache, "draft": str(args.draft) if "draft" in modes else None,
              "modes": modes, "num_draft_tokens": args.num_draft_tokens, "rounds": args.rounds,
              "tokens": args.tokens} | compared
    write(args.out, result)
    print(json.dumps({"parity": compared["parity"], "summary": compared["summary"]}, indent=2))
    return 0 if compared["parity"] else 1


if __name__ == "__main__":
    sys.exit(main())
