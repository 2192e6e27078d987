"""Section prefill_itl: inter-token latency of decoding streams while a long prompt is prefilled.

For each HTTP side (mlxsup, one daemon per step target asked for; mlx_lm.server), same model:
  baseline  N streaming chat requests generating `itl_baseline_tokens` each: every gap between two
            consecutive tokens of a stream (its ITL);
  prefill   the same N streams; once every one has `itl_lead_tokens` tokens, one more request with a
            long prompt (`itl_long_prompt_words` words, max_tokens 1) is sent. The prefill window is
            from its send to its first token; a stream's gap counts when it overlaps the window (the
            stall a long prefill causes is exactly such a gap). After every stream has
            `itl_tail_tokens` more tokens, the client disconnects them (both servers abort then).
Reported per side: ITL p50 / p95 / max for both runs, the long prompt's tokens and TTFT, and the
tokens the streams received during the window. Sides alternate order every round; every side gets
the same prompts, new ones each round and run, and mlxsup a fresh state directory (no prompt-cache
reuse: its SSD tier would otherwise keep the long prompt of an earlier run). Imports no MLX.
"""

from __future__ import annotations

import asyncio
import shutil
import time

from bench import client as cl
from bench.common import median, percentile, rnd
from bench.prompts import prompts
from bench.servers import MlxLmServer, Mlxsup


def _stats(gaps: list[float]) -> dict:
    return {"n": len(gaps), "p50_s": rnd(percentile(gaps, 50), 5), "p95_s": rnd(percentile(gaps, 95), 5),
            "max_s": rnd(max(gaps), 5) if gaps else None}


def _arrivals(rec: dict) -> list[float]:
    return [rec["start"] + t for t in rec["times"]] if rec.get("start") is not None else []


def gaps_overlapping(recs: list[dict], t0: float, t1: float) -> list[float]:
    """Every gap between consecutive tokens of a stream that overlaps [t0, t1] (perf_counter seconds)."""
    out = []
    for rec in recs:
        ts = _arrivals(rec)
        out += [b - a for a, b in zip(ts, ts[1:]) if a < t1 and b > t0]
    return out


def all_gaps(recs: list[dict]) -> list[float]:
    return [b - a for rec in recs for a, b in zip(rec["times"], rec["times"][1:])]


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.005)


class Side:
    """One server under test: where to send, what model name and extra body fields."""

    def __init__(self, name: str, server, model: str, extra: dict) -> None:
        self.name, self.server, self.model, self.extra = name, server, model, extra

    def body(self, messages: list, max_tokens: int) -> dict:
        return cl.chat_body(self.model, messages, max_tokens, self.extra)


async def baseline_run(side: Side, p, msgs: list) -> dict:
    recs = await cl.run_concurrent(side.server.chat_url, [side.body(m, p.itl_baseline_tokens) for m in msgs],
                                   p.run_timeout_s)
    errors = [r["error"] for r in recs if r["error"]]
    return {"itl": _stats(all_gaps(recs)), "tokens": [len(r["times"]) for r in recs], "errors": errors[:3]}


async def prefill_run(side: Side, p, msgs: list, long_msgs: list) -> dict:
    """N streams, then the long prompt; the streams' gaps overlapping its prefill."""
    url = side.server.chat_url
    conns = await cl.open_connections(url, len(msgs) + 1)
    recs = [cl.new_record() for _ in msgs]
    streams = [asyncio.create_task(cl.stream_chat(url, side.body(m, p.itl_stream_max_tokens), p.run_timeout_s,
                                                  conn=c, rec=r)) for m, c, r in zip(msgs, conns, recs)]
    long_rec = cl.new_record()
    out: dict = {}
    try:
        await _until(lambda: all(len(r["times"]) >= p.itl_lead_tokens or r["error"] for r in recs),
                     p.run_timeout_s, f"{p.itl_lead_tokens} tokens on every stream")
        before = [len(r["times"]) for r in recs]
        await cl.stream_chat(url, side.body(long_msgs, 1), p.run_timeout_s, conn=conns[-1], rec=long_rec)
        t0 = long_rec["start"]
        t1 = t0 + long_rec["times"][0] if long_rec["times"] else time.perf_counter()
        at_end = [sum(1 for t in _arrivals(r) if t <= t1) for r in recs]
        await _until(lambda: all(len(r["times"]) >= n + p.itl_tail_tokens or r["done"] or r["error"]
                                 for r, n in zip(recs, at_end)),
                     p.run_timeout_s, f"{p.itl_tail_tokens} more tokens on every stream")
        usage = long_rec.get("usage") or {}
        out = {
            "itl_during_prefill": _stats(gaps_overlapping(recs, t0, t1)),
            "itl_before_prefill": _stats(gaps_overlapping(recs, -1e18, t0)),
            "long_prompt_tokens": usage.get("prompt_tokens"),
            "long_ttft_s": rnd(t1 - t0, 4),
            "long_error": long_rec["error"],
            "stream_tokens_during_prefill": sum(a - b for a, b in zip(at_end, before)),
            "streams_alive_at_end": sum(1 for r in recs if not r["done"] and not r["error"]),
            "errors": [r["error"] for r in recs if r["error"]][:3],
        }
    finally:
        for task in streams:
            task.cancel()  # the client leaves: both servers abort the generation on disconnect
        await asyncio.gather(*streams, return_exceptions=True)
        conns[-1][1].close()
    return out


async def run(bench) -> dict:
    """The section, driven by bench.run.Bench (its params, client, model and process bookkeeping)."""
    p = bench.p
    res: dict = {"runs": [], "notes": [
        f"{p.itl_streams} streaming chat requests decode; once each has {p.itl_lead_tokens} tokens, one request "
        f"with a {p.itl_long_prompt_words}-word prompt (max_tokens 1) is sent",
        "ITL during prefill: gaps between consecutive tokens of a stream that overlap the long prompt's window "
        "(its send to its first token); baseline: every gap of the same streams without the long prompt",
        "mlxsup sides: one daemon per step target (default: the daemon's own step_target_s); mlx_lm.server "
        "with its defaults (prefill_step_size 2048)",
        "streams are cut by a client disconnect once each has received "
        f"{p.itl_tail_tokens} tokens after the long prompt's first token",
    ]}
    sides: list[Side] = []
    for target in p.itl_step_targets:
        name = "mlxsup" if target is None else f"mlxsup step_target_s={target}"
        state = bench.work / f"state-itl-{target or 'default'}"
        shutil.rmtree(state, ignore_errors=True)  # no prompt cache (SSD tier) left by an earlier run
        state.mkdir(parents=True)
        args: list[str] = []
        if target is not None:
            (state / "itl.toml").write_text(f"[server]\nstep_target_s = {target}\n")
            args = ["--config", str(state / "itl.toml")]
        sides.append(Side(name, Mlxsup(bench.work / "models", state, args=args), bench.model_id, {"ignore_eos": True}))
    mlxlm = MlxLmServer(bench.model_dir, bench.work / "logs" / "mlx_lm_server_itl.log")
    sides.append(Side("mlx_lm.server", mlxlm, "default_model", {}))
    try:
        await asyncio.gather(*(bench.start(s.server) for s in sides))
        for s in sides:
            if isinstance(s.server, Mlxsup):
                await s.server.load(bench.client, bench.model_id)
                s.server.track()
        for s in sides:  # warm-up: first calls, kernel shapes of this concurrency (not measured)
            await cl.run_concurrent(s.server.chat_url, [s.body(m, 2) for m in prompts("itlw", p.itl_streams,
                                                                                     p.prompt_words, p.seed)],
                                    p.run_timeout_s)
        for r in range(p.itl_rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for s in order:
                if bench.left() < 30:
                    res.setdefault("skipped", []).append({"round": r, "side": s.name})
                    continue
                msgs = prompts(f"itl{r}", p.itl_streams, p.prompt_words, p.seed)  # the same on every side
                long_msgs = prompts(f"itl-long{r}", 1, p.itl_long_prompt_words, p.seed)[0]
                row = {"round": r, "side": s.name, "baseline": await baseline_run(s, p, msgs)}
                row["prefill"] = await prefill_run(s, p, prompts(f"itlp{r}", p.itl_streams, p.prompt_words, p.seed),
                                                   long_msgs)
                res["runs"].append(row)
                d, b = row["prefill"].get("itl_during_prefill", {}), row["baseline"]["itl"]
                bench.log(f"itl r={r} {s.name}: baseline p50 {rnd(b['p50_s'], 3)} max {rnd(b['max_s'], 3)} s; "
                          f"during prefill p50 {rnd(d.get('p50_s'), 3)} max {rnd(d.get('max_s'), 3)} s; long prompt "
                          f"{row['prefill'].get('long_prompt_tokens')} tokens, TTFT {row['prefill'].get('long_ttft_s')} s")
                bench.results["prefill_itl"] = res
                bench.save()
    finally:
        for s in sides:
            await bench.stop(s.server)
    res["summary"] = summarize(res["runs"], [s.name for s in sides])
    return res


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per side, medians over rounds of each percentile (one round: its values)."""
    out: dict = {}
    for name in names:
        rs = [r for r in runs if r["side"] == name and r.get("prefill", {}).get("itl_during_prefill")]
        if not rs:
            continue

        def med(run_key: str, stat_key: str, key: str) -> float | None:
            return median([r[run_key].get(stat_key, {}).get(key) for r in rs])

        out[name] = {
            "rounds": len(rs),
            "baseline_p50_s": med("baseline", "itl", "p50_s"), "baseline_p95_s": med("baseline", "itl", "p95_s"),
            "baseline_max_s": med("baseline", "itl", "max_s"),
            "prefill_p50_s": med("prefill", "itl_during_prefill", "p50_s"),
            "prefill_p95_s": med("prefill", "itl_during_prefill", "p95_s"),
            "prefill_max_s": med("prefill", "itl_during_prefill", "max_s"),
            "long_prompt_tokens": median([r["prefill"].get("long_prompt_tokens") for r in rs]),
            "long_ttft_s": median([r["prefill"].get("long_ttft_s") for r in rs]),
            "stream_tokens_during_prefill": median([r["prefill"].get("stream_tokens_during_prefill") for r in rs]),
            "errors": sum(len(r["baseline"]["errors"]) + len(r["prefill"].get("errors", [])) for r in rs),
        }
    return out


def markdown(sec: dict) -> list[str]:
    """The section's part of results.md."""
    L = ["## 6. Inter-token latency while a long prompt is prefilled (issue 10)\n"]
    for note in sec.get("notes", []):
        L.append(f"- {note}")
    L.append("")
    L.append("| side | ITL without the long prompt p50 / p95 / max | ITL during its prefill p50 / p95 / max | "
             "long prompt tokens | its TTFT | stream tokens during its prefill | rounds |")
    L.append("| --- | --- | --- | --- | --- | --- | --- |")
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
    for name, s in sec.get("summary", {}).items():
        L.append(f"| {name} | {ms(s['baseline_p50_s'])} / {ms(s['baseline_p95_s'])} / {ms(s['baseline_max_s'])} ms | "
                 f"{ms(s['prefill_p50_s'])} / {ms(s['prefill_p95_s'])} / {ms(s['prefill_max_s'])} ms | "
                 f"{s['long_prompt_tokens']} | {s['long_ttft_s']} s | {s['stream_tokens_during_prefill']} | "
                 f"{s['rounds']} |")
    if sec.get("skipped"):
        L.append(f"\nSkipped for the deadline: {sec['skipped']}")
    if sec.get("error"):
        L.append(f"\nThe section stopped early: `{sec['error']}`")
    L.append("")
    return L
