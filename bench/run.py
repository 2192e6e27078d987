"""The benchmark harness: every section, one command. See bench/README.md.

Sections (bench/QUESTIONS.md says which question each answers):
  throughput  1/8/32 concurrent streaming clients: in-process mlx-lm (the ceiling) vs mlxsup vs mlx_lm.server
  cold_start  first request to first token for a model not loaded vs mlx_lm.load + first token in-process
  eviction    evict an idle worker and one with 8 streams in flight; is the process gone, is memory back
  overhead    per-chunk time mlxsup adds between the worker producing a token and the client receiving it
  cache       bench/cache_bench.py's results, run here or the committed ones (section_cache)
  prefill_itl ITL of 8 decoding streams while a long prompt is prefilled, and without (bench/prefill_itl.py)
  resume      the pause of a stream whose worker is SIGKILLed, with and without prompt caches (bench/resume_pause.py)

The harness itself never imports MLX: the sides run in their own processes, and every process it
starts is stopped and proven gone in a finally.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx
import psutil

from bench import client as cl
from bench import prefill_itl, resume_pause, servers
from bench.bands import speed_bands
from bench.bound import bandwidth_gb_s, bound_lines, decode_bound, weight_bytes
from bench.common import REPO, machine, median, now, percentile, ratio, rnd, write_json
from bench.model import make_never_eos_view, make_source_model
from bench.params import Params
from bench.profile import Spy, find_pyspy, summarize_collapsed
from bench.prompts import prompts
from bench.servers import InProc, MlxLmServer, Mlxsup, alive, cold_inproc

SIDES = ("inproc", "mlxsup", "mlx_lm.server")
B_SIDE = "mlxsup_b"  # another checkout's mlxsup (params.mlxsup_b), in the same rounds: an A/B of two trees
DIAG_SIDE = "inproc_batch"  # BatchGenerator at batch 1: the engine mlxsup's worker runs, without the server

def available() -> int:
    """System available memory, the median of three reads 50 ms apart."""
    vals = []
    for i in range(3):
        if i:
            time.sleep(0.05)
        vals.append(psutil.virtual_memory().available)
    return int(sorted(vals)[1])


def gpu_used_bytes() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(sum(float(x) for x in out) * 2**20)
    except Exception:
        return None


def summarize(records: list[dict], expected: int) -> dict:
    """One run: aggregate tokens/s, TTFT and inter-token latency (ITL) percentiles, exactness."""
    ok = [r for r in records if not r.get("error") and r["times"]]
    errors = [r.get("error") for r in records if r.get("error")]
    out: dict = {"requests": len(records), "errors": errors[:5], "n_errors": len(errors)}
    if not ok:
        return out
    t0 = min(r["start"] for r in ok)
    t1 = max(r["start"] + r["times"][-1] for r in ok)
    tokens = [r["completion_tokens"] for r in ok]
    ttft = [r["times"][0] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    # Steady state: tokens arriving while every request is past its first token and none has finished.
    w0 = max(r["start"] + r["times"][0] for r in ok)
    w1 = min(r["start"] + r["times"][-1] for r in ok)
    in_window = sum(1 for r in ok for t in r["times"] if w0 < r["start"] + t <= w1)
    out.update(
        steady_tok_s=in_window / (w1 - w0) if w1 - w0 > 0 and in_window else None,
        ramp_s=w0 - t0,  # from the first request to the last first token
        tail_s=t1 - w1,  # from the first request's last token to the last one's
        ttft_p50_s=percentile(ttft, 50),
        itl_p50_s=percentile(itl, 50),
        wall_s=t1 - t0,
        tokens=sum(t or 0 for t in tokens),
        tok_s=sum(t or 0 for t in tokens) / (t1 - t0) if t1 > t0 else None,
        exact=all(t == expected for t in tokens) and len(ok) == len(records),
        completion_tokens=sorted(set(tokens)),
        prompt_tokens=sorted({r.get("prompt_tokens") for r in ok}),
        events_per_request=median([len(r["times"]) for r in ok]),
        ttft=ttft,
        itl=itl,
    )
    return out


def http_records(recs: list[dict]) -> list[dict]:
    for r in recs:
        usage = r.get("usage") or {}
        r["completion_tokens"] = usage.get("completion_tokens")
        r["prompt_tokens"] = usage.get("prompt_tokens")
        if not r.get("error") and r["completion_tokens"] is None:
            r["error"] = "no usage in the stream"
    return recs


class Bench:
    def __init__(self, params: Params, work: Path, out: Path, source_model: Path | None, sections: list[str],
                 command: str) -> None:
        self.p = params
        self.work = work
        self.out = out
        self.source_model = source_model
        self.sections = sections
        self.t_start = time.monotonic()
        self.results: dict = {"meta": {"command": command, "params": params.to_dict(), "sections": sections,
                                       "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
        servers.SERVER_CPUS = servers.parse_cpus(params.server_cpus)
        if servers.SERVER_CPUS:
            self.results["meta"]["server_cpus"] = ",".join(map(str, sorted(servers.SERVER_CPUS)))
        if params.client_cpus and hasattr(os, "sched_setaffinity"):  # the harness off the servers' CPUs
            mine = os.sched_getaffinity(0)
            cpus = (mine - (servers.SERVER_CPUS or set()) if params.client_cpus == "rest"
                    else servers.parse_cpus(params.client_cpus) or set())
            if cpus:
                os.sched_setaffinity(0, cpus)
                self.results["meta"]["client_cpus"] = ",".join(map(str, sorted(cpus)))
        self.managed: list = []
        self.client = None
        self.model_id = ""
        self.model_dir: Path | None = None

    # --- plumbing ---------------------------------------------------------------------

    def left(self) -> float:
        return self.p.deadline_s - (time.monotonic() - self.t_start)

    def log(self, msg: str) -> None:
        print(f"[bench {time.monotonic() - self.t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        write_json(self.out / "results.json", self.results)

    async def start(self, proc):
        self.managed.append(proc)
        await proc.start()
        return proc

    async def stop(self, proc) -> None:
        if proc in self.managed:
            self.managed.remove(proc)
        proof = await proc.stop()
        self.results.setdefault("cleanup", {})[f"{proc.name}@{proc.pid}"] = proof
        self.log(f"stopped {proc.name}: {proof}")

    # --- main ---------------------------------------------------------------------------

    async def run(self) -> dict:
        self.results["meta"]["machine"] = machine()
        self.prepare_model()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False)
        try:
            for name in ("throughput", "cold_start", "eviction", "overhead", "profile", "cache", "prefill_itl", "resume"):
                if name not in self.sections:
                    continue
                if self.left() < 5:
                    self.results[name] = {"skipped": "deadline reached"}
                    continue
                self.log(f"section {name} ({self.left():.0f}s left)")
                try:
                    self.results[name] = await getattr(self, "section_" + name)()
                except Exception as exc:
                    self.log(f"section {name} failed: {exc!r}")
                    self.results[name] = {**self.results.get(name, {}), "error": repr(exc),
                                          "traceback": traceback.format_exc()[-3000:]}
                self.save()
        finally:
            for proc in list(self.managed):
                try:
                    await self.stop(proc)
                except Exception as exc:
                    self.log(f"could not stop {proc.name}: {exc!r}")
            await self.client.aclose()
            self.results["targets"] = targets(self.results)
            self.results["meta"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.results["meta"]["all_processes_gone"] = all(
                v == "gone" for c in self.results.get("cleanup", {}).values() for v in c["pids"].values())
            self.save()
        return self.results

    def prepare_model(self) -> None:
        src = self.source_model or make_source_model(self.work / "source" / self.p.preset, self.p.preset, self.p.seed)
        self.model_id = f"bench-{self.p.preset}"
        root = self.work / "models"
        self.model_dir = root / self.model_id
        info = make_never_eos_view(src, self.model_dir)
        info["id"] = self.model_id
        info["preset"] = self.p.preset
        self.results["meta"]["model"] = info
        self.log(f"model {info}")

    async def quiesce(self, d: Mlxsup, timeout: float = 90.0) -> bool | None:
        """Wait until the daemon's spare worker (if it keeps one) is standing by: a steady state to measure from."""
        deadline = time.monotonic() + timeout
        while True:
            st = await d.status(self.client)
            if "spare" not in st:
                return None  # this mlxsup keeps no spare
            spare = st.get("spare")
            if spare and spare.get("pid"):
                d.seen.add(spare["pid"])
            if spare is None or spare.get("standing_by"):
                return bool(spare)
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)

    # --- a side's run -------------------------------------------------------------------

    async def http_run(self, url: str, model: str, msgs: list, max_tokens: int, extra: dict | None = None) -> list:
        bodies = [cl.chat_body(model, m, max_tokens, extra) for m in msgs]
        return http_records(await cl.run_concurrent(url, bodies, self.p.run_timeout_s))

    async def side_run(self, side: str, servers: dict, c: int, max_tokens: int, tag: str) -> list[dict]:
        msgs = prompts(tag, c, self.p.prompt_words, self.p.seed)
        if side in ("inproc", DIAG_SIDE):
            mode = "stream" if side == "inproc" and c == 1 else "batch"
            out = await servers["inproc"].run(mode, msgs, max_tokens, self.p.run_timeout_s)
            return out["records"]
        if side in ("mlxsup", B_SIDE):
            return await self.http_run(servers[side].chat_url, self.model_id, msgs, max_tokens,
                                       {"ignore_eos": True})
        return await self.http_run(servers["mlx_lm.server"].chat_url, "default_model", msgs, max_tokens)

    # --- 1. throughput and latency ------------------------------------------------------

    async def section_throughput(self) -> dict:
        p = self.p
        res: dict = {"runs": [], "notes": [
            "inproc at c=1 is mlx_lm.stream_generate; at c>1 BatchGenerator(32/8) with all prompts inserted at once",
            "inproc_batch is BatchGenerator at batch 1 (the engine mlxsup's worker runs), a diagnostic",
            "mlxsup gets ignore_eos=true; the served model's EOS is unreachable on every side (bench/model.py)",
            "TTFT and ITL from content-bearing SSE events (HTTP) or generated tokens (in-process)",
            "tok/s = generated tokens of the run / (last token - first request); median over rounds",
            "mlx_lm.server keeps its default LRU prompt cache: each chat request reuses the KV of the shared "
            "chat-template prefix (a few tokens) from earlier requests; mlxsup has no prompt cache yet",
        ]}
        inproc = InProc(self.model_dir, self.work / "logs" / "inproc.log")
        mlxsup = Mlxsup(self.work / "models", self.work / "state-throughput",
                        env=dict(kv.split("=", 1) for kv in p.mlxsup_env))
        mlxlm = MlxLmServer(self.model_dir, self.work / "logs" / "mlx_lm_server.log")
        servers = {"inproc": inproc, "mlxsup": mlxsup, "mlx_lm.server": mlxlm}
        if p.mlxsup_b:
            servers[B_SIDE] = Mlxsup(self.work / "models", self.work / "state-throughput-b",
                                     env=dict(kv.split("=", 1) for kv in (*p.mlxsup_env, *p.mlxsup_b_env)),
                                     tree=Path(p.mlxsup_b))
            res["mlxsup_b_tree"] = p.mlxsup_b
            res["mlxsup_b_env"] = list(p.mlxsup_b_env)
        daemons = [d for d in (mlxsup, servers.get(B_SIDE)) if d is not None]
        try:
            await asyncio.gather(*(self.start(x) for x in servers.values()))
            res["inproc_info"] = inproc.info
            for d in daemons:
                await d.load(self.client, self.model_id)
                d.track()
            if p.await_warm_up:
                for d in daemons:
                    key = "mlxsup_warm_up_s" if d is mlxsup else "mlxsup_b_warm_up_s"
                    res[key] = await d.warmed_up(self.model_id, timeout=60)
                    self.log(f"{key}: {res[key]} s")
            for c in p.concurrency:
                sides = list(SIDES) + ([B_SIDE] if B_SIDE in servers else []) + ([DIAG_SIDE] if c == 1 else [])
                wt = p.warmup_tokens.get(c, 0)
                for side in sides:  # warm-up: first calls, kernel compilation, shapes of this concurrency
                    if self.left() < 10 or not wt:
                        break
                    await self.side_run(side, servers, c, wt, f"w{c}")
                for r in range(p.rounds.get(c, 1)):
                    order = sides if r % 2 == 0 else sides[::-1]
                    for side in order:
                        est = max([x["wall_s"] for x in res["runs"] if x.get("c") == c and "wall_s" in x] or [0])
                        if self.left() < est * 1.2 + 5:
                            res.setdefault("skipped", []).append({"c": c, "round": r, "side": side})
                            continue
                        t = now()
                        recs = await self.side_run(side, servers, c, p.tokens[c], f"r{r}c{c}")
                        s = summarize(recs, p.tokens[c])
                        s.update(c=c, round=r, side=side, harness_wall_s=now() - t)
                        res["runs"].append(s)
                        self.log(f"c={c} r={r} {side}: {rnd(s.get('tok_s'), 2)} tok/s, exact={s.get('exact')}, "
                                 f"errors={s['n_errors']}")
                    self.results["throughput"] = res
                    self.save()
            st = await mlxsup.model(self.client, self.model_id)
            res["mlxsup_peak_batch_size"] = st.get("peak_batch_size")
            if p.burst_probe and self.left() > 60:
                # Not part of the comparison: n clients connecting in the same instant, no pre-opened connections.
                n = max(p.concurrency)
                res["connect_burst"] = {}
                for side, url, model, extra in (("mlxsup", mlxsup.chat_url, self.model_id, {"ignore_eos": True}),
                                                ("mlx_lm.server", mlxlm.chat_url, "default_model", {})):
                    body = cl.chat_body(model, prompts("burst", 1, p.prompt_words, p.seed)[0], 1, extra)
                    res["connect_burst"][side] = await cl.connect_burst_probe(url, n, body, p.run_timeout_s)
                self.log(f"connect burst: {res['connect_burst']}")
        except Exception as exc:  # keep what was measured
            self.log(f"throughput stopped early: {exc!r}")
            res["error"] = repr(exc)
            res["traceback"] = traceback.format_exc()[-3000:]
        finally:
            for proc in servers.values():
                await self.stop(proc)
        res["summary"] = summarize_throughput(res["runs"], p)
        gpus = self.results["meta"].get("machine", {}).get("gpus") or []
        res["bound"] = decode_bound(res["summary"], weight_bytes(self.model_dir), *bandwidth_gb_s(gpus, p.bandwidth_gbs))
        for line in bound_lines(res["bound"]):
            self.log(line)
        for run in res["runs"]:  # the raw samples live in the summary's pooled percentiles
            run.pop("ttft", None)
            run.pop("itl", None)
        return res

    # --- 2. cold start --------------------------------------------------------------------

    async def section_cold_start(self) -> dict:
        p = self.p
        res: dict = {"rounds": [], "notes": [
            "mlxsup: daemon running, model not loaded, its spare worker (if any) standing by; a streaming request "
            "(max_tokens 1) until its first token; the model is evicted between rounds",
            "inproc: a fresh process; mlx_lm.load + first token (load_plus_first_token_s); imports and the "
            "interpreter start are reported apart",
        ]}
        d = Mlxsup(self.work / "models", self.work / "state-cold")
        try:
            await self.start(d)
            # warm the page cache for both sides equally: one load and evict, not measured
            await d.load(self.client, self.model_id)
            await d.evict(self.client, self.model_id)
            for r in range(p.cold_rounds):
                if self.left() < 30:
                    res["skipped_rounds"] = p.cold_rounds - r
                    break
                row: dict = {"round": r}
                order = ["inproc", "mlxsup"] if r % 2 == 0 else ["mlxsup", "inproc"]
                for side in order:
                    msgs = prompts(f"cold{r}", 1, p.prompt_words, p.seed)[0]
                    if side == "inproc":
                        row["inproc"] = await cold_inproc(self.model_dir, msgs, self.work / "logs" / "cold.log")
                    else:
                        spare = await self.quiesce(d)
                        st = await d.model(self.client, self.model_id)
                        assert st["state"] == "stopped", f"model not unloaded before a cold start: {st['state']}"
                        body = cl.chat_body(self.model_id, msgs, 1, {"ignore_eos": True})
                        rec = await cl.stream_chat(d.chat_url, body, p.run_timeout_s)
                        ev = await d.evict(self.client, self.model_id)
                        row["mlxsup"] = {"ttft_s": rec["times"][0] if rec["times"] else None, "error": rec["error"],
                                         "evict_s": ev.get("duration_s"), "pid": ev.get("pid"),
                                         "spare_standing_by": spare}
                        if ev.get("pid"):
                            d.seen.add(ev["pid"])
                m, i = row.get("mlxsup", {}), row.get("inproc", {})
                row["delta_s"] = (m["ttft_s"] - i["load_plus_first_token_s"]) if m.get("ttft_s") and i else None
                res["rounds"].append(row)
                self.log(f"cold r={r}: mlxsup {rnd(m.get('ttft_s'), 3)}s vs inproc load+first "
                         f"{rnd(i.get('load_plus_first_token_s'), 3)}s (+import {rnd(i.get('import_s'), 3)}s)")
        finally:
            await self.stop(d)
        rs = res["rounds"]
        # The worker's own load time (Engine init: mlx_lm.load + BatchGenerator), from the daemon's log line
        # "[load] model=.. pid=N ready in Xs" (best effort: the format belongs to supervisor/router.py).
        loads = {int(m.group(1)): float(m.group(2)) for m in
                 re.finditer(r"\[load\] model=\S+ pid=(\d+) ready in ([\d.]+)s", d.log_path.read_text(errors="replace"))}
        for r in rs:
            m = r.get("mlxsup", {})
            if m.get("pid") in loads and m.get("ttft_s") is not None:
                m["worker_engine_load_s"] = loads[m["pid"]]
                m["ttft_minus_engine_load_s"] = m["ttft_s"] - loads[m["pid"]]
        res["summary"] = {
            "mlxsup_worker_engine_load_s": median([r.get("mlxsup", {}).get("worker_engine_load_s") for r in rs]),
            "mlxsup_ttft_minus_engine_load_s": median([r.get("mlxsup", {}).get("ttft_minus_engine_load_s") for r in rs]),
            "delta_vs_interpreter_to_first_token_s": median(
                [r["mlxsup"]["ttft_s"] - r["inproc"]["interpreter_to_first_token_s"] for r in rs
                 if r.get("mlxsup", {}).get("ttft_s") and r.get("inproc")]),
            "mlxsup_ttft_s": median([r.get("mlxsup", {}).get("ttft_s") for r in rs]),
            "inproc_load_plus_first_token_s": median([r.get("inproc", {}).get("load_plus_first_token_s") for r in rs]),
            "inproc_load_s": median([r.get("inproc", {}).get("load_s") for r in rs]),
            "inproc_import_s": median([r.get("inproc", {}).get("import_s") for r in rs]),
            "inproc_interpreter_to_first_token_s": median(
                [r.get("inproc", {}).get("interpreter_to_first_token_s") for r in rs]),
            "delta_s": median([r.get("delta_s") for r in rs]),
            "rounds": len(rs),
        }
        return res

    # --- 3. eviction ---------------------------------------------------------------------

    async def section_eviction(self) -> dict:
        p = self.p
        res: dict = {"idle": [], "busy": [], "notes": [
            "available = psutil.virtual_memory().available (median of 3 reads): before load, loaded, after evict; "
            "each read with the daemon at rest (its spare worker, if any, standing by)",
            "returned_bytes = available after evict - available while loaded; "
            "baseline_delta_bytes = available after evict - available before load (0 = all back)",
            "wall_s: client-side time of POST /api/models/{id}/evict, which answers once the process is reaped",
            f"busy: {p.busy_streams} streaming requests each past its first token, then evict mode=now",
        ]}
        d = Mlxsup(self.work / "models", self.work / "state-evict")
        try:
            await self.start(d)
            for kind, n in (("idle", p.idle_evict_rounds), ("busy", p.busy_evict_rounds)):
                for r in range(n):
                    if self.left() < 30:
                        res.setdefault("skipped", []).append({"kind": kind, "round": r})
                        continue
                    row = await self.evict_round(d, kind, r)
                    res[kind].append(row)
                    self.log(f"evict {kind} r={r}: wall {rnd(row.get('wall_s'), 3)}s, gone={row.get('process_gone')}, "
                             f"returned {(row.get('returned_bytes') or 0) / 2**20:.0f} MiB")
                    self.results["eviction"] = res
                    self.save()
        finally:
            await self.stop(d)
        for kind in ("idle", "busy"):
            rows = res[kind]
            res[f"summary_{kind}"] = {
                "rounds": len(rows),
                "wall_s": median([x.get("wall_s") for x in rows]),
                "server_duration_s": median([x.get("report", {}).get("duration_s") for x in rows]),
                "worker_rss_bytes": median([x.get("worker_rss_bytes") for x in rows]),
                "returned_bytes": median([x.get("returned_bytes") for x in rows]),
                "baseline_delta_bytes": median([x.get("baseline_delta_bytes") for x in rows]),
                "gpu_returned_bytes": median([x.get("gpu_returned_bytes") for x in rows]),
                "all_gone": all(x.get("process_gone") for x in rows) if rows else None,
                "max_wall_s": max([x.get("wall_s") or 0 for x in rows] or [0]),
            }
        return res

    async def evict_round(self, d: Mlxsup, kind: str, r: int) -> dict:
        p = self.p
        row: dict = {"round": r}
        row["spare_standing_by"] = await self.quiesce(d)  # memory is read with the daemon at rest each time
        await asyncio.sleep(0.3)
        row["avail_before_load"] = await asyncio.to_thread(available)
        g0 = gpu_used_bytes()
        load = await d.load(self.client, self.model_id)
        pid = load["pid"]
        row["pid"] = pid
        await asyncio.sleep(0.5)
        tasks = []
        if kind == "busy":
            events = [asyncio.Event() for _ in range(p.busy_streams)]
            msgs = prompts(f"busy{r}", p.busy_streams, p.prompt_words, p.seed)
            tasks = [asyncio.create_task(cl.stream_chat(
                d.chat_url, cl.chat_body(self.model_id, m, p.busy_max_tokens, {"ignore_eos": True}),
                p.run_timeout_s, first_token=e)) for m, e in zip(msgs, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), p.run_timeout_s)
            st = await d.model(self.client, self.model_id)
            row["in_flight"] = st.get("in_flight")
            row["batch_size"] = st.get("batch_size")
        if kind == "idle":
            await self.quiesce(d)
        st = await d.model(self.client, self.model_id)
        row["worker_rss_bytes"] = st.get("memory_bytes")
        row["avail_loaded"] = await asyncio.to_thread(available)
        g1 = gpu_used_bytes()
        t = now()
        rep = await d.evict(self.client, self.model_id, mode="now" if kind == "busy" else "drain")
        row["wall_s"] = now() - t
        row["process_gone"] = not alive(pid)
        row["report"] = rep
        if tasks:
            recs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            row["streams"] = [{"tokens_received": len(x["times"]), "error": x["error"], "done": x["done"]}
                              for x in recs]
            row["streams_ended_with_error_event"] = all(
                isinstance(x["error"], dict) and x["error"].get("code") for x in recs)
        await self.quiesce(d)
        await asyncio.sleep(0.5)
        row["avail_after_evict"] = await asyncio.to_thread(available)
        g2 = gpu_used_bytes()
        row["returned_bytes"] = row["avail_after_evict"] - row["avail_loaded"]
        row["baseline_delta_bytes"] = row["avail_after_evict"] - row["avail_before_load"]
        if None not in (g0, g1, g2):
            row.update(gpu_used_before_load=g0, gpu_used_loaded=g1, gpu_used_after_evict=g2,
                       gpu_returned_bytes=g1 - g2)
        return row

    # --- 5. gateway overhead ----------------------------------------------------------------

    async def section_overhead(self) -> dict:
        p = self.p
        trace_dir = self.work / "trace"
        shutil.rmtree(trace_dir, ignore_errors=True)
        trace_dir.mkdir(parents=True)
        env = {"MLXSUP_BENCH_TRACE_DIR": str(trace_dir),
               "PYTHONPATH": os.pathsep.join([str(REPO / "bench" / "trace"), str(REPO),
                                               *filter(None, [os.environ.get("PYTHONPATH")])])}
        res: dict = {"method": (
            "A dedicated mlxsup daemon whose worker is traced by bench/trace/sitecustomize.py (no change to "
            "worker/): t_produced = when BatchGenerator.next() returned the step's tokens to the host, t_sent = "
            "after the Tokens message left on ZeroMQ. The client stamps each content-bearing SSE event on "
            "arrival (time.monotonic_ns, the same system clock). Chunks are matched per request id in order. "
            "overhead = t_client - t_produced = worker-side detokenize+encode+send (t_sent - t_produced) + "
            "transport, router, SSE shaping, uvicorn, loopback TCP and the client's read (t_client - t_sent)."),
            "runs": []}
        d = Mlxsup(self.work / "models", self.work / "state-overhead", env=env)
        recs_all: list[dict] = []
        try:
            await self.start(d)
            await d.load(self.client, self.model_id)
            d.track()
            for c in p.overhead_concurrency:
                await self.http_run(d.chat_url, self.model_id, prompts(f"ow{c}", c, p.prompt_words, p.seed),
                                    p.warmup_tokens.get(c, 2) or 2, {"ignore_eos": True})
                for r in range(p.overhead_rounds):
                    if self.left() < 20:
                        break
                    recs = await self.http_run(d.chat_url, self.model_id,
                                               prompts(f"o{r}c{c}", c, p.prompt_words, p.seed),
                                               p.overhead_tokens, {"ignore_eos": True})
                    for x in recs:
                        x["c"] = c
                    recs_all += recs
            await d.evict(self.client, self.model_id)  # the worker exits and writes its trace
        finally:
            await self.stop(d)
        trace = load_trace(trace_dir)
        res["trace_records"] = sum(len(v) for v in trace.values())
        for c in p.overhead_concurrency:
            res["runs"].append(match_overhead([x for x in recs_all if x["c"] == c], trace, c))
        if not trace:
            res["error"] = "no worker trace was written (did the patch apply? see the daemon log)"
        # Method 2 (cross-check): inter-token latency at batch 1 through mlxsup minus in-process BatchGenerator.
        tp = self.results.get("throughput", {}).get("summary", {}).get("1", {})
        if tp:
            a, b, s = (tp.get(k, {}).get("itl_p50_s") for k in ("mlxsup", DIAG_SIDE, "inproc"))
            res["itl_delta_vs_batchgen_ms"] = rnd((a - b) * 1e3, 3) if a is not None and b is not None else None
            res["itl_delta_vs_stream_generate_ms"] = rnd((a - s) * 1e3, 3) if a is not None and s is not None else None
        return res

    # --- profile of mlxsup's hot path ----------------------------------------------------------

    async def section_profile(self) -> dict:
        """py-spy on the daemon and the worker while clients stream (not a timed comparison)."""
        p = self.p
        exe = find_pyspy()
        if exe is None:
            return {"skipped": "py-spy not found (pip install py-spy)"}
        pdir = self.work / "profile"
        shutil.rmtree(pdir, ignore_errors=True)
        pdir.mkdir(parents=True)
        res: dict = {"tool": exe, "workload": [], "notes": [
            "py-spy record --idle --nonblocking --rate 200: shares are of wall-clock samples of the loop's thread",
            "worker thread = stacks through WorkerLoop.run; daemon thread = stacks through the asyncio loop",
        ]}
        d = Mlxsup(self.work / "models", self.work / "state-profile")
        spies: list[Spy] = []
        try:
            await self.start(d)
            load = await d.load(self.client, self.model_id)
            d.track()
            spies = [Spy(exe, d.pid, pdir / "daemon.txt"), Spy(exe, load["pid"], pdir / "worker.txt")]
            for s in spies:
                s.start()
            await asyncio.sleep(1.0)
            for c in p.profile_concurrency:
                t = now()
                n = 0
                for r in range(p.profile_rounds):
                    if self.left() < 20:
                        break
                    recs = await self.http_run(d.chat_url, self.model_id, prompts(f"p{r}c{c}", c, p.prompt_words,
                                                                                   p.seed), p.tokens[c], {"ignore_eos": True})
                    n += sum(x.get("completion_tokens") or 0 for x in recs)
                res["workload"].append({"c": c, "tokens": n, "wall_s": round(now() - t, 3)})
        finally:
            res["py_spy_exit"] = [await s.stop() for s in spies]
            await self.stop(d)
        res["worker"] = summarize_collapsed(pdir / "worker.txt", "WorkerLoop.run (worker/")
        res["daemon"] = summarize_collapsed(pdir / "daemon.txt", "run_forever (asyncio/base_events.py)")
        for name in ("worker", "daemon"):
            src = pdir / f"{name}.txt"
            if src.exists() and src.stat().st_size < 4 * 2**20:
                self.out.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, self.out / f"profile-{name}.collapsed.txt")
        return res

    # --- 6. inter-token latency during a long prefill ----------------------------------------

    async def section_prefill_itl(self) -> dict:
        return await prefill_itl.run(self)

    async def section_resume(self) -> dict:
        return await resume_pause.run(self)

    # --- 4. cache (slot) ----------------------------------------------------------------------

    async def section_cache(self) -> dict:
        # ---------------------------------------------------------------------------------------
        # CACHE (section 4). The prompt-cache benchmark is bench/cache_bench.py (TTFT of one long prompt:
        # cold, hot-cache hit, SSD hit after evict + reload). This section includes its results: it runs it
        # (profile param run_cache_bench, a subprocess bounded by the deadline, on this run's preset) or else
        # takes the committed CPU result (bench/results/cpu/cache/cache_bench.json).
        # Its JSON goes under "cache" and its markdown into results.md as section 4.
        # ---------------------------------------------------------------------------------------
        script = REPO / "bench" / "cache_bench.py"
        if not script.exists():
            return {"status": "pending", "note": "bench/cache_bench.py has not landed yet (separate branch)"}
        p = self.p
        if p.run_cache_bench and self.left() > 60:
            out = self.out / "cache"
            argv = [sys.executable, str(script), "--preset", p.preset, "--tokens", str(p.cache_tokens),
                    "--out", str(out), "--work", str(self.work / "cache")]
            shutil.rmtree(self.work / "cache", ignore_errors=True)
            (self.work / "cache").mkdir(parents=True)
            with open(self.work / "logs" / "cache_bench.log", "ab") as log:
                proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, stdout=log, stderr=log)
                try:
                    rc = await asyncio.wait_for(proc.wait(), max(30.0, self.left() - 10))
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    return {"status": "timed out", "command": " ".join(argv[1:])}
            src, how = out / "cache_bench.json", f"ran here: {' '.join(argv[1:])} (exit {rc})"
        else:
            src, how = REPO / "bench" / "results" / "cpu" / "cache" / "cache_bench.json", "included from bench/results/cpu/cache"
        if not src.exists():
            return {"status": "no results", "note": how}
        data = json.loads(src.read_text())
        md_path = src.with_suffix(".md")
        md = md_path.read_text() if md_path.exists() else ""
        md = "\n".join(line for line in md.splitlines() if not line.startswith("# "))  # its own title
        return {"status": how, "results": data, "markdown": f"_{how}_\n{md}"}


# --- summaries -------------------------------------------------------------------------------


def summarize_throughput(runs: list[dict], p: Params) -> dict:
    summary: dict = {}
    for c in p.concurrency:
        cs: dict = {}
        for side in (*SIDES, B_SIDE, DIAG_SIDE):
            rs = [r for r in runs if r["c"] == c and r["side"] == side and r.get("tok_s")]
            if not rs:
                continue
            ttft = [x for r in rs for x in r.get("ttft", [])]
            itl = [x for r in rs for x in r.get("itl", [])]
            cs[side] = {
                "rounds": len(rs),
                "tok_s": median([r["tok_s"] for r in rs]),
                "tok_s_min": min(r["tok_s"] for r in rs),
                "tok_s_max": max(r["tok_s"] for r in rs),
                "steady_tok_s": median([r.get("steady_tok_s") for r in rs]),
                "ramp_s": median([r.get("ramp_s") for r in rs]), "tail_s": median([r.get("tail_s") for r in rs]),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
                "itl_p50_s": percentile(itl, 50), "itl_p95_s": percentile(itl, 95),
                "exact_all_rounds": all(r.get("exact") for r in rs),
                "completion_tokens": sorted({t for r in rs for t in r.get("completion_tokens", []) if t is not None}),
                "prompt_tokens": sorted({t for r in rs for t in r.get("prompt_tokens", []) if t is not None}),
                "events_per_request": median([r.get("events_per_request") for r in rs]),
                "errors": sum(r["n_errors"] for r in rs),
            }

        def round_ratios(a: str, b: str, key: str) -> list[float]:
            """Side a's `key` over side b's, round by round (the rounds where both have it)."""
            per_round = []
            for r in sorted({x["round"] for x in runs if x["c"] == c}):
                ra = [x for x in runs if x["c"] == c and x["round"] == r and x["side"] == a and x.get(key)]
                rb = [x for x in runs if x["c"] == c and x["round"] == r and x["side"] == b and x.get(key)]
                if ra and rb:
                    per_round.append(ra[0][key] / rb[0][key])
            return per_round

        def paired(a: str, b: str) -> dict:
            per_round = round_ratios(a, b, "tok_s")
            return {"median_of_round_ratios": median(per_round), "per_round": [rnd(x, 4) for x in per_round],
                    "ratio_of_medians": ratio(cs.get(a, {}).get("tok_s"), cs.get(b, {}).get("tok_s"))}

        def paired_key(a: str, b: str, key: str) -> float | None:
            return median(round_ratios(a, b, key))

        cs["steady_ratios"] = {"mlxsup/inproc": paired_key("mlxsup", "inproc", "steady_tok_s"),
                               "mlxsup/mlx_lm.server": paired_key("mlxsup", "mlx_lm.server", "steady_tok_s")}
        cs["ratios"] = {"mlxsup/inproc": paired("mlxsup", "inproc"),
                        "mlxsup/mlx_lm.server": paired("mlxsup", "mlx_lm.server"),
                        "mlx_lm.server/inproc": paired("mlx_lm.server", "inproc")}

        def itl_paired(a: str, b: str) -> dict:  # a's ITL p50 over b's, per round (below 1: a's tokens come faster)
            per_round = round_ratios(a, b, "itl_p50_s")
            return {"median_of_round_ratios": median(per_round), "per_round": [rnd(x, 4) for x in per_round]}

        cs["itl_ratios"] = {"mlxsup/inproc": itl_paired("mlxsup", "inproc")}
        cs["bands"] = speed_bands(runs, c)  # the host's fast and slow rounds, per side (bench/bands.py)
        if B_SIDE in cs:
            cs["ratios"][f"{B_SIDE}/inproc"] = paired(B_SIDE, "inproc")
            cs["ratios"][f"mlxsup/{B_SIDE}"] = paired("mlxsup", B_SIDE)
            cs["itl_ratios"][f"{B_SIDE}/inproc"] = itl_paired(B_SIDE, "inproc")
            cs["itl_ratios"][f"mlxsup/{B_SIDE}"] = itl_paired("mlxsup", B_SIDE)
            cs["steady_ratios"][f"{B_SIDE}/inproc"] = paired_key(B_SIDE, "inproc", "steady_tok_s")
        if c == 1:
            cs["ratios"]["mlxsup/inproc_batch"] = paired("mlxsup", DIAG_SIDE)
            cs["ratios"]["inproc_batch/inproc"] = paired(DIAG_SIDE, "inproc")
        summary[str(c)] = cs
    return summary


def load_trace(trace_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """rid -> [(t_produced_ns, t_sent_ns)] for every non-empty text chunk the worker sent, in order."""
    by_rid: dict[str, list[tuple[int, int]]] = {}
    for f in sorted(trace_dir.glob("trace-*.jsonl")):
        for line in f.read_text().splitlines():
            kind, t_gen, t_sent, chunks = json.loads(line)
            for rid, n in chunks:
                if n > 0:
                    by_rid.setdefault(rid, []).append((t_gen, t_sent))
    return by_rid


def match_overhead(recs: list[dict], trace: dict, c: int) -> dict:
    total, worker, transit = [], [], []
    matched = mismatched = 0
    for r in recs:
        chunks = trace.get(r.get("rid") or "", [])
        if r.get("error") or not chunks or len(chunks) != len(r["mono_ns"]):
            mismatched += 1
            continue
        matched += 1
        for (t_gen, t_sent), t_cli in zip(chunks, r["mono_ns"]):
            total.append((t_cli - t_gen) / 1e6)
            worker.append((t_sent - t_gen) / 1e6)
            transit.append((t_cli - t_sent) / 1e6)
    q = lambda xs, k: rnd(percentile(xs, k), 4)  # noqa: E731
    return {"c": c, "requests_matched": matched, "requests_unmatched": mismatched, "chunks": len(total),
            "overhead_ms_p50": q(total, 50), "overhead_ms_p95": q(total, 95), "overhead_ms_p99": q(total, 99),
            "worker_side_ms_p50": q(worker, 50), "worker_side_ms_p95": q(worker, 95),
            "after_send_ms_p50": q(transit, 50), "after_send_ms_p95": q(transit, 95)}


def targets(results: dict) -> list[dict]:
    out = []
    tp = results.get("throughput", {}).get("summary", {})

    def add(name: str, measured, goal: str, met) -> None:
        out.append({"target": name, "measured": measured, "goal": goal,
                    "met": None if met is None else bool(met)})

    r1 = tp.get("1", {}).get("ratios", {}).get("mlxsup/inproc", {}).get("median_of_round_ratios")
    add("single stream: mlxsup tok/s vs in-process stream_generate", rnd(r1, 3), ">= 0.97",
        None if r1 is None else r1 >= 0.97)
    c32 = tp.get("32", {}).get("ratios", {})
    a = c32.get("mlxsup/inproc", {}).get("median_of_round_ratios")
    add("32 streams: mlxsup vs in-process BatchGenerator", rnd(a, 3), ">= 0.95", None if a is None else a >= 0.95)
    b = c32.get("mlxsup/mlx_lm.server", {}).get("median_of_round_ratios")
    add("32 streams: mlxsup vs mlx_lm.server", rnd(b, 3), ">= 1.0", None if b is None else b >= 1.0)
    cs = results.get("cold_start", {}).get("summary", {})
    dlt = cs.get("delta_s")
    add("cold start: mlxsup first token minus in-process load + first token (s)", rnd(dlt, 3), "<= 1.0 s",
        None if dlt is None else dlt <= 1.0)
    oh = [x for x in results.get("overhead", {}).get("runs", []) if x.get("c") == 1]
    g = oh[0].get("overhead_ms_p50") if oh else None
    add("gateway overhead per chunk, p50 at batch 1 (ms)", g, "< 1 ms", None if g is None else g < 1.0)
    ev = results.get("eviction", {}).get("summary_idle", {})
    w = ev.get("wall_s")
    add("issue 3: idle evict returns (median wall, s)", rnd(w, 3), "< 1 s, process gone",
        None if w is None else (w < 1.0 and bool(ev.get("all_gone"))))
    return out


def itl_cross_check(results: dict) -> None:
    """Method 2 of the overhead section, from section 1's one-client runs."""
    oh = results.get("overhead")
    tp = results.get("throughput", {}).get("summary", {}).get("1", {})
    if not oh or not tp:
        return
    a, b, s = (tp.get(k, {}).get("itl_p50_s") for k in ("mlxsup", DIAG_SIDE, "inproc"))
    oh["itl_delta_vs_batchgen_ms"] = rnd((a - b) * 1e3, 3) if a is not None and b is not None else None
    oh["itl_delta_vs_stream_generate_ms"] = rnd((a - s) * 1e3, 3) if a is not None and s is not None else None


def merge_results(base: dict, extra: dict) -> dict:
    """Sections of two runs on the same machine and model (a device call is limited to 10 minutes)."""
    out = json.loads(json.dumps(base))
    taken = []
    for name in ("throughput", "cold_start", "eviction", "overhead", "profile", "cache", "prefill_itl", "resume"):
        sec = extra.get(name)
        if sec and "skipped" not in sec and (name not in out or "skipped" in out[name] or name != "cache"):
            if name in out and "skipped" not in out[name] and name == "throughput":
                continue  # keep the base's comparison
            out[name] = sec
            taken.append(name)
    out.setdefault("cleanup", {}).update({f"run2:{k}": v for k, v in extra.get("cleanup", {}).items()})
    out["meta"]["merged"] = {"second_run_command": extra["meta"].get("command"),
                             "second_run_started_utc": extra["meta"].get("started_utc"),
                             "second_run_elapsed_s": extra["meta"].get("elapsed_s"), "sections_from_second_run": taken}
    out["meta"]["all_processes_gone"] = all(
        v == "gone" for c in out.get("cleanup", {}).values() for v in c["pids"].values())
    itl_cross_check(out)
    out["targets"] = targets(out)
    return out
