"""results.json -> results.md (tables) and chart.png (matplotlib, optional: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bands import SAME_DECODE
from bench.bound import bound_lines
from bench.prefill_itl import markdown as prefill_itl_markdown
from bench.resume_pause import markdown as resume_markdown

SIDE_ORDER = ("inproc", "mlxsup", "mlxsup_b", "mlx_lm.server", "inproc_batch")
SIDE_LABEL = {"inproc": "in-process mlx-lm (ceiling)", "mlxsup": "mlxsup (HTTP gateway)",
              "mlxsup_b": "mlxsup B (another tree, HTTP gateway)",
              "mlx_lm.server": "mlx_lm.server", "inproc_batch": "in-process BatchGenerator b=1 (diag.)"}


def _f(x, nd: int = 2, scale: float = 1.0, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x * scale:.{nd}f}{unit}"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


def markdown(res: dict) -> str:
    meta = res.get("meta", {})
    m = meta.get("machine", {})
    p = meta.get("params", {})
    model = meta.get("model", {})
    L: list[str] = []
    L.append(f"# mlxsup benchmark: profile `{p.get('profile')}`, preset `{p.get('preset')}`\n")
    L.append(f"Run {meta.get('started_utc')} .. {meta.get('finished_utc')} ({meta.get('elapsed_s')} s), "
             f"command `{meta.get('command')}`.\n")
    if meta.get("merged"):
        mg = meta["merged"]
        L.append(f"Joined with a second run on the same machine (a device call is limited to 10 minutes): "
                 f"{', '.join(mg['sections_from_second_run'])} from `{mg['second_run_command']}` "
                 f"(started {mg['second_run_started_utc']}).\n")
    L.append("## Machine\n")
    L.append(f"- CPU: {m.get('cpu_model')}, {m.get('logical_cores')} logical cores "
             f"({m.get('physical_cores')} physical), RAM {(m.get('ram_bytes') or 0) / 2**30:.1f} GiB, "
             f"{m.get('os')} {m.get('arch')}, Python {m.get('python')}")
    if m.get("gpus"):
        L.append(f"- GPU: {'; '.join(m['gpus'])}")
    dev = res.get("throughput", {}).get("inproc_info", {}).get("device")
    if dev:
        L.append(f"- MLX device: {dev}")
    v = m.get("versions", {})
    L.append("- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    g = m.get("git", {})
    L.append(f"- mlxsup commit {str(g.get('commit'))[:12]}{' (+ uncommitted changes in the tree)' if g.get('dirty') else ''}; "
             f"load average at start {m.get('load_avg_at_start')}" + (f"; tree: {m['tree']}" if m.get("tree") else ""))
    L.append(f"- model: `{model.get('id')}` from `mlxsup make-model --preset {model.get('preset')}` "
             f"({_mib(model.get('weights_bytes'))} of {model.get('dtype')} weights), EOS made unreachable "
             f"(id {model.get('eos_token_id')} = vocab size) so every side generates exactly max_tokens\n")
    L.append("## Parameters\n")
    L.append(f"- concurrency {p.get('concurrency')}; generated tokens per request {p.get('tokens')}; "
             f"rounds {p.get('rounds')}; warm-up tokens {p.get('warmup_tokens')}; prompt words {p.get('prompt_words')}")
    L.append(f"- cold-start rounds {p.get('cold_rounds')}; idle/busy eviction rounds {p.get('idle_evict_rounds')}/"
             f"{p.get('busy_evict_rounds')} ({p.get('busy_streams')} streams); overhead: c={p.get('overhead_concurrency')}, "
             f"{p.get('overhead_tokens')} tokens x {p.get('overhead_rounds')} rounds; deadline {p.get('deadline_s')} s")
    if res.get("meta", {}).get("server_cpus"):
        L.append(f"- every side's server pinned to CPUs {res['meta']['server_cpus']} (bench.params server_cpus)")
    if res.get("meta", {}).get("client_cpus"):
        L.append(f"- the harness (its HTTP clients) pinned to CPUs {res['meta']['client_cpus']} (bench.params client_cpus)")
    L.append("- sides alternate order every round (A B C, then C B A); greedy sampling everywhere; "
             "ratios are medians of per-round ratios of back-to-back runs\n")

    if any(t["met"] is not None for t in res.get("targets", [])):  # a run of other sections only has none
        L.append("## Targets\n")
        L.append("| target | goal | measured | met |")
        L.append("| --- | --- | --- | --- |")
        for t in res.get("targets", []):
            met = {True: "**met**", False: "**not met**", None: "n/a"}[t["met"]]
            L.append(f"| {t['target']} | {t['goal']} | {t['measured']} | {met} |")
        L.append("")

    tp = res.get("throughput", {})
    if tp.get("summary"):
        L.append("## 1. Throughput and latency (streaming)\n")
        L.append("| clients | side | tok/s (median) | min..max | steady tok/s | TTFT p50 / p95 | ITL p50 / p95 | rounds | exact tokens |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for c, cs in tp["summary"].items():
            for side in SIDE_ORDER:
                s = cs.get(side)
                if not s:
                    continue
                L.append(f"| {c} | {SIDE_LABEL[side]} | {_f(s['tok_s'], 1)} | {_f(s['tok_s_min'], 1)}..{_f(s['tok_s_max'], 1)} | "
                         f"{_f(s.get('steady_tok_s'), 1)} | "
                         f"{_f(s['ttft_p50_s'], 1, 1e3)} / {_f(s['ttft_p95_s'], 1, 1e3)} ms | "
                         f"{_f(s['itl_p50_s'], 2, 1e3)} / {_f(s['itl_p95_s'], 2, 1e3)} ms | {s['rounds']} | "
                         f"{'yes' if s['exact_all_rounds'] else 'NO'} {s['completion_tokens']} |")
        L.append("")
        L.append("| clients | mlxsup / in-process | mlxsup / mlx_lm.server | mlx_lm.server / in-process | "
                 "steady: mlxsup / in-process | steady: mlxsup / mlx_lm.server | per-round mlxsup / in-process |")
        L.append("| --- | --- | --- | --- | --- | --- | --- |")
        for c, cs in tp["summary"].items():
            r = cs.get("ratios", {})
            sr = cs.get("steady_ratios", {})
            L.append(f"| {c} | {_f(r.get('mlxsup/inproc', {}).get('median_of_round_ratios'), 3)} | "
                     f"{_f(r.get('mlxsup/mlx_lm.server', {}).get('median_of_round_ratios'), 3)} | "
                     f"{_f(r.get('mlx_lm.server/inproc', {}).get('median_of_round_ratios'), 3)} | "
                     f"{_f(sr.get('mlxsup/inproc'), 3)} | {_f(sr.get('mlxsup/mlx_lm.server'), 3)} | "
                     f"{r.get('mlxsup/inproc', {}).get('per_round')} |")
        L.append("")
        L.append("| clients | ITL p50: mlxsup / in-process | per round |")
        L.append("| --- | --- | --- |")
        for c, cs in tp["summary"].items():
            ir = cs.get("itl_ratios", {}).get("mlxsup/inproc", {})
            L.append(f"| {c} | {_f(ir.get('median_of_round_ratios'), 3)} | {ir.get('per_round')} |")
        if any("mlxsup_b" in cs for cs in tp["summary"].values()):
            L.append(f"\nA/B: side mlxsup_b ran the tree `{tp.get('mlxsup_b_tree')}` in the same rounds"
                     f"{', with ' + ' '.join(tp['mlxsup_b_env']) if tp.get('mlxsup_b_env') else ''}.\n")
            L.append("| clients | tok/s mlxsup / mlxsup_b | per round | mlxsup_b / in-process | per round | "
                     "ITL p50 mlxsup / mlxsup_b | ITL p50 mlxsup_b / in-process | steady mlxsup_b / in-process |")
            L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for c, cs in tp["summary"].items():
                r, ir = cs.get("ratios", {}), cs.get("itl_ratios", {})
                ab, b = r.get("mlxsup/mlxsup_b", {}), r.get("mlxsup_b/inproc", {})
                L.append(f"| {c} | {_f(ab.get('median_of_round_ratios'), 3)} | {ab.get('per_round')} | "
                         f"{_f(b.get('median_of_round_ratios'), 3)} | {b.get('per_round')} | "
                         f"{_f(ir.get('mlxsup/mlxsup_b', {}).get('median_of_round_ratios'), 3)} | "
                         f"{_f(ir.get('mlxsup_b/inproc', {}).get('median_of_round_ratios'), 3)} | "
                         f"{_f(cs.get('steady_ratios', {}).get('mlxsup_b/inproc'), 3)} |")
        L.extend(_wall_and_bands(tp["summary"]))
        L.append("\nsteady tok/s: tokens arriving while every request of the run is past its first token and none has "
                 "finished, over that window: decode speed without the admission/prefill ramp. Ratios are medians "
                 "of per-round ratios.")
        r1 = tp["summary"].get("1", {}).get("ratios", {})
        if r1.get("mlxsup/inproc_batch"):
            L.append(f"\nAt one client: mlxsup / in-process BatchGenerator(b=1) = "
                     f"{_f(r1['mlxsup/inproc_batch'].get('median_of_round_ratios'), 3)}; BatchGenerator(b=1) / "
                     f"stream_generate = {_f(r1.get('inproc_batch/inproc', {}).get('median_of_round_ratios'), 3)}.")
        if tp.get("bound"):
            L.append("")
            L.extend(bound_lines(tp["bound"]))
        if tp.get("skipped"):
            L.append(f"\nSkipped for the deadline: {tp['skipped']}")
        if tp.get("error"):
            L.append(f"\nThe section stopped early: `{tp['error']}`")
        L.append("")

    cs = res.get("cold_start", {})
    if cs.get("summary"):
        s = cs["summary"]
        L.append("## 2. Cold start\n")
        L.append("| measure | median (s) |")
        L.append("| --- | --- |")
        L.append(f"| mlxsup: request to first token, model not loaded | {_f(s['mlxsup_ttft_s'], 3)} |")
        L.append(f"| in-process: mlx_lm.load + first token | {_f(s['inproc_load_plus_first_token_s'], 3)} |")
        L.append(f"| in-process: of which mlx_lm.load | {_f(s['inproc_load_s'], 3)} |")
        L.append(f"| in-process: Python imports of mlx + mlx_lm (not in the above) | {_f(s['inproc_import_s'], 3)} |")
        L.append(f"| in-process: interpreter start to first token | {_f(s['inproc_interpreter_to_first_token_s'], 3)} |")
        L.append(f"| **difference mlxsup - (load + first token)** (the target) | **{_f(s['delta_s'], 3)}** |")
        L.append(f"| difference mlxsup - (interpreter start to first token), like for like | "
                 f"{_f(s.get('delta_vs_interpreter_to_first_token_s'), 3)} |")
        L.append(f"| mlxsup worker: Engine init (mlx_lm.load + BatchGenerator), from the daemon log | "
                 f"{_f(s.get('mlxsup_worker_engine_load_s'), 3)} |")
        L.append(f"| mlxsup: first token minus that Engine init (spawn, imports, handshake, HTTP, prefill) | "
                 f"{_f(s.get('mlxsup_ttft_minus_engine_load_s'), 3)} |")
        L.append(f"\n{s['rounds']} rounds, alternating order.\n")
    elif cs.get("error"):
        L.append(f"## 2. Cold start\n\nfailed: `{cs['error']}`\n")

    ev = res.get("eviction", {})
    if ev.get("summary_idle") or ev.get("summary_busy"):
        L.append("## 3. Eviction (issue 3)\n")
        L.append("| case | rounds | evict wall (median / max) | server duration | worker RSS before | "
                 "available memory returned | after evict vs before load | GPU memory returned | process gone |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for kind, label in (("idle", "idle worker, mode drain"), ("busy", "8 streams in flight, mode now")):
            s = ev.get(f"summary_{kind}")
            if not s or not s.get("rounds"):
                continue
            L.append(f"| {label} | {s['rounds']} | {_f(s['wall_s'], 3)} / {_f(s['max_wall_s'], 3)} s | "
                     f"{_f(s['server_duration_s'], 3)} s | {_mib(s['worker_rss_bytes'])} | {_mib(s['returned_bytes'])} | "
                     f"{_mib(s['baseline_delta_bytes'])} | {_mib(s['gpu_returned_bytes'])} | "
                     f"{'yes' if s['all_gone'] else 'NO'} |")
        busy = ev.get("busy", [])
        if busy:
            ok = all(b.get("streams_ended_with_error_event") for b in busy)
            L.append(f"\nBusy rounds: every stream ended with a clean SSE error event: {'yes' if ok else 'NO'}; "
                     f"phases of the first: {busy[0].get('report', {}).get('phases_s')}.")
        L.append("")

    oh = res.get("overhead", {})
    if oh.get("runs") or oh.get("error"):
        L.append("## 5. Gateway overhead per chunk\n")
        L.append(oh.get("method", "") + "\n")
        L.append("| clients | chunks | overhead p50 / p95 / p99 | worker side p50 / p95 | after send p50 / p95 | requests matched |")
        L.append("| --- | --- | --- | --- | --- | --- |")
        for r in oh.get("runs", []):
            L.append(f"| {r['c']} | {r['chunks']} | {_f(r['overhead_ms_p50'], 3)} / {_f(r['overhead_ms_p95'], 3)} / "
                     f"{_f(r['overhead_ms_p99'], 3)} ms | {_f(r['worker_side_ms_p50'], 3)} / {_f(r['worker_side_ms_p95'], 3)} ms | "
                     f"{_f(r['after_send_ms_p50'], 3)} / {_f(r['after_send_ms_p95'], 3)} ms | "
                     f"{r['requests_matched']} (unmatched {r['requests_unmatched']}) |")
        if oh.get("itl_delta_vs_batchgen_ms") is not None:
            L.append(f"\nCross-check from section 1 (one client): ITL p50 through mlxsup minus in-process "
                     f"BatchGenerator(b=1) = {oh['itl_delta_vs_batchgen_ms']} ms; minus stream_generate = "
                     f"{oh.get('itl_delta_vs_stream_generate_ms')} ms (the per-token cost on the generation "
                     f"loop's critical path, as opposed to the latency above).")
        if oh.get("error"):
            L.append(f"\n{oh['error']}")
        L.append("")

    dg = res.get("diagnostics") or {}
    if dg:
        L.append("## Diagnostics (python -m bench.diagnose)\n")
        L.append("Measured earlier in the same session on other machines of the same kind (H100, same MLX). "
                 "imports, exit and arrival exercise only MLX / mlx-lm; engine drives worker.mlx_engine.engine.Engine.\n")
        im = dg.get("imports") or {}
        if im.get("top_cumulative_s"):
            top = ", ".join(f"{n} {t:.2f} s" for n, d, t in im["top_cumulative_s"][:4])
            L.append(f"- **imports** of what the worker imports: {im.get('wall_s')} s wall; heavy modules pulled in: "
                     f"{im.get('heavy_modules_loaded')}; cumulative: {top}")
        ex = dg.get("exit") or {}
        if ex:
            L.append("- **process exit** after the model was loaded and used, end of work to reaped (s): " +
                     "; ".join(f"{k} {v}" for k, v in ex.items() if not k.startswith("error")))
        ar = dg.get("arrival") or {}
        if ar.get("runs"):
            runs = "; ".join(f"{r['mode']}: {r['tok_s']} tok/s, TTFT p50 {r['ttft_p50_ms']} ms" for r in ar["runs"])
            L.append(f"- **arrival** ({ar['n']} sequences x {ar['tokens']} tokens, in-process BatchGenerator): {runs}. "
                     f"Step time for a (generation batch, prefill batch) shape seen for the first time: p50 "
                     f"{ar['step_ms_first_seen_shape']['p50']} ms / p95 {ar['step_ms_first_seen_shape']['p95']} ms "
                     f"({ar['step_ms_first_seen_shape']['count']} steps); seen before: p50 "
                     f"{ar['step_ms_seen_before']['p50']} ms ({ar['step_ms_seen_before']['count']} steps)")
        en = dg.get("engine") or {}
        if en.get("itl_p50_ms_median"):
            L.append("- **engine** (one process, batch 1, ITL p50 ms, median of rounds): " +
                     "; ".join(f"{k} {v}" for k, v in en["itl_p50_ms_median"].items()))
        L.append("")

    if "cache" in meta.get("sections", ["cache"]):
        L.append("## 4. Cache\n")
        cache = res.get("cache", {})
        if cache.get("markdown"):
            L.append(cache["markdown"])
        else:
            L.append(f"**Slot (pending):** {cache.get('note') or cache.get('status') or 'not run'}. "
                     "bench/cache_bench.py plugs in here when it lands (see bench/run.py, section_cache).")
        L.append("")
    itl = res.get("prefill_itl", {})
    if itl.get("summary") or itl.get("error"):
        L += prefill_itl_markdown(itl)
    if res.get("resume", {}).get("sides"):
        L += resume_markdown(res["resume"])
    cleanup = res.get("cleanup", {})
    L.append("## Processes\n")
    L.append(f"Every process started was stopped and checked gone: **{'yes' if meta.get('all_processes_gone') else 'NO'}** "
             f"({sum(len(c['pids']) for c in cleanup.values())} pids across {len(cleanup)} servers).")
    return "\n".join(L) + "\n"


def _wall_and_bands(summary: dict) -> list[str]:
    """Where each side's wall goes beside its steady state (ramp: to the last first token; tail: from the first
    request's end), and the host's fast and slow rounds (bench/bands.py): each side's count and ITL p50 in each."""
    L = ["", "| clients | side | ramp / tail (medians) | fast rounds | ITL p50 in fast / slow rounds |",
         "| --- | --- | --- | --- | --- |"]
    for c, cs in summary.items():
        bands = (cs.get("bands") or {}).get("sides", {})
        for side in SIDE_ORDER:
            s, b = cs.get(side), bands.get(side)
            if not s:
                continue
            one = "bands" in cs and cs["bands"] is None and side in SAME_DECODE  # computed, and no gap found
            fast = f"{b['fast']} of {b['rounds']}" if b else "one band" if one else ""
            itl = f"{_f(b['fast_itl_p50_s'], 2, 1e3)} / {_f(b['slow_itl_p50_s'], 2, 1e3)} ms" if b else ""
            L.append(f"| {c} | {side} | {_f(s.get('ramp_s'), 0, 1e3)} / {_f(s.get('tail_s'), 0, 1e3)} ms | {fast} | {itl} |")
    return L


def chart(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summ = res.get("throughput", {}).get("summary", {})
    if not summ:
        return False
    conc = list(summ.keys())
    sides = ("inproc", "mlxsup", "mlx_lm.server")
    colors = {"inproc": "#4c72b0", "mlxsup": "#dd8452", "mlx_lm.server": "#55a868"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("tok_s", 1.0, "aggregate tokens/s (median, min-max)"), ("ttft_p50_s", 1e3, "TTFT p50 (ms)"),
              ("itl_p50_s", 1e3, "inter-token latency p50 (ms)"))
    width = 0.27
    for ax, (key, scale, title) in zip(axes, panels):
        for i, side in enumerate(sides):
            xs, ys, lo, hi = [], [], [], []
            for j, c in enumerate(conc):
                s = summ[c].get(side)
                if not s or s.get(key) is None:
                    continue
                xs.append(j + (i - 1) * width)
                ys.append(s[key] * scale)
                if key == "tok_s":
                    lo.append(s[key] - s["tok_s_min"])
                    hi.append(s["tok_s_max"] - s[key])
            err = [lo, hi] if key == "tok_s" and xs else None
            ax.bar(xs, ys, width, label=SIDE_LABEL[side], color=colors[side], yerr=err, capsize=3)
        ax.set_xticks(range(len(conc)))
        ax.set_xticklabels([f"{c} client{'s' if c != '1' else ''}" for c in conc])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    p = res.get("meta", {}).get("params", {})
    dev = res.get("throughput", {}).get("inproc_info", {}).get("device", "")
    fig.suptitle(f"mlxsup bench, profile {p.get('profile')}, preset {p.get('preset')}, {dev}, tokens/request "
                 f"{p.get('tokens')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(results_json: Path, out_dir: Path | None = None) -> list[Path]:
    res = json.loads(results_json.read_text())
    out_dir = out_dir or results_json.parent
    md = out_dir / "results.md"
    md.write_text(markdown(res))
    written = [md]
    png = out_dir / "chart.png"
    if chart(res, png):
        written.append(png)
    return written
