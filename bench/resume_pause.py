"""Section resume: the pause a stream sees when its worker is SIGKILLed and the request resumes.

For each side (mlxsup with its prompt caches on, the default; mlxsup with `[cache] enabled = false`),
one daemon on a fresh state directory, the same model:
  warm      one request with the round's prompt (`resume_prompt_words` words) and max_tokens 1, so
            the prompt is in the caches (as an earlier turn of a conversation leaves it); with caches
            off it only loads the model;
  resumed   the same prompt streamed greedily for `resume_tokens` tokens (ignore_eos); once the
            client has `resume_lead_tokens` tokens, the worker is SIGKILLed. The request is suspended,
            a new worker loads, and the continuation (prompt + the tokens sent) is prefilled: from
            the SSD tier when caches are on (the hot tier died with the worker), from scratch when off.
Reported per side and round: the client's pause (the gap between the last token before the kill and
the first after it), the router's own account from its log (suspended -> resubmitted: waiting for a
worker; resubmitted -> first token: the continuation's prefill), the prompt's tokens, and whether
the text equals an uninterrupted greedy run of the same request (`exact`). Imports no MLX.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import httpx

from bench.common import median, rnd
from bench.servers import Mlxsup

_RESUBMITTED = re.compile(r"rid=(\S+) resubmitted to pid=\d+ after ([\d.]+)s suspended")
_FLOWING = re.compile(r"rid=(\S+) flowing again on pid=\d+: paused ([\d.]+)s")


async def _stream(http: httpx.AsyncClient, url: str, body: dict, on_token) -> dict:
    """Stream a completion; `on_token(n)` after each text event. Returns text, arrival times, usage, error."""
    out: dict = {"text": "", "times": [], "usage": None, "error": None, "rid": None}
    async with http.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()[:300]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]
                return out
            out["rid"] = data.get("id", out["rid"])
            if data.get("usage"):
                out["usage"] = data["usage"]
            if data.get("choices") and data["choices"][0].get("text"):
                out["text"] += data["choices"][0]["text"]
                out["times"].append(time.perf_counter())
                await on_token(len(out["times"]))
    return out


def _router_account(log_text: str, rid: str) -> dict:
    """What the daemon's log says of the request's pause: waiting for a worker, then to its first token."""
    waited = [float(s) for r, s in _RESUBMITTED.findall(log_text) if r == rid]
    paused = [float(s) for r, s in _FLOWING.findall(log_text) if r == rid]
    if not waited or not paused:
        return {"suspended_to_resubmitted_s": None, "resubmitted_to_first_token_s": None, "router_pause_s": None}
    return {"suspended_to_resubmitted_s": waited[0], "resubmitted_to_first_token_s": rnd(paused[0] - waited[0], 3),
            "router_pause_s": paused[0]}


async def side_run(bench, name: str, cache_on: bool) -> dict:
    p = bench.p
    state = bench.work / f"state-resume-{name}"
    shutil.rmtree(state, ignore_errors=True)  # no SSD cache of an earlier run
    state.mkdir(parents=True)
    cfg = state / "resume.toml"
    cfg.write_text("[server]\nrestart_backoff_s = 0.05\ncrash_limit = 100\n"
                   + ("" if cache_on else "\n[cache]\nenabled = false\n"))
    server = Mlxsup(bench.work / "models", state, args=["--config", str(cfg)])
    await server.start()
    rounds = []
    try:
        async with httpx.AsyncClient(timeout=p.run_timeout_s) as http:
            url = server.url + "/v1/completions"
            for i in range(p.resume_rounds):
                words = " ".join(f"w{(i * 7919 + k) % 1000}" for k in range(p.resume_prompt_words))
                prompt = f"Round {i} of {name}: {words}"
                body = {"model": bench.model_id, "prompt": prompt, "max_tokens": p.resume_tokens, "temperature": 0.0,
                        "ignore_eos": True}
                warm = await http.post(url, json={**body, "max_tokens": 1})
                warm.raise_for_status()
                ref = await http.post(url, json=body)  # the uninterrupted run (it leaves its KV in the caches too)
                ref.raise_for_status()
                await http.post(url, json={**body, "prompt": f"x{i}", "max_tokens": 1})  # another last request
                pid = (await server.model(http, bench.model_id))["pid"]

                async def on_token(n: int, pid: int = pid) -> None:
                    if n == p.resume_lead_tokens:
                        os.kill(pid, signal.SIGKILL)

                got = await _stream(http, url, body, on_token)
                times = got["times"]
                lead = p.resume_lead_tokens
                pause = times[lead] - times[lead - 1] if len(times) > lead else None
                log_text = (state / "daemon.log").read_text(errors="replace")
                rounds.append({
                    "prompt_tokens": (got["usage"] or {}).get("prompt_tokens"),
                    "cached_tokens": ((got["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "client_pause_s": rnd(pause, 3),
                    **_router_account(log_text, got["rid"] or ""),
                    "exact": got["text"] == ref.json()["choices"][0]["text"],
                    "completion_tokens": (got["usage"] or {}).get("completion_tokens"),
                    "error": got["error"],
                })
            status = await server.model(http, bench.model_id)
    finally:
        await server.stop()
    pauses = [r["client_pause_s"] for r in rounds if r["client_pause_s"] is not None]
    return {"side": name, "cache": cache_on, "rounds": rounds, "client_pause_median_s": rnd(median(pauses), 3),
            "resumed": status.get("resumed"), "resume_failed": status.get("resume_failed")}


async def run(bench) -> dict:
    """The section, driven by bench.run.Bench (its params, model and work folder)."""
    p = bench.p
    res: dict = {"notes": [
        f"a greedy stream of {p.resume_tokens} tokens on a {p.resume_prompt_words}-word prompt; its worker is "
        f"SIGKILLed once the client has {p.resume_lead_tokens} tokens; the request resumes on a new worker",
        "before it, the same prompt was seen (max_tokens 1, then the whole run): with caches on, the SSD tier "
        "has its blocks (the hot tier dies with the worker); with caches off, the continuation is prefilled whole",
        "client pause: the gap between the tokens before and after the kill; router: suspended -> resubmitted "
        "(a new worker), resubmitted -> first token (the continuation's prefill), from the daemon's log",
    ], "sides": []}
    for name, cache_on in (("caches on", True), ("caches off", False)):
        res["sides"].append(await side_run(bench, name.replace(" ", "-"), cache_on))
    return res


def markdown(res: dict) -> list[str]:
    lines = ["## Resume after a worker crash (issue 18)", ""] + [f"- {n}" for n in res.get("notes", [])] + [""]
    lines += ["| side | prompt tokens | cached (last worker) | client pause (s) | waiting for a worker (s) "
              "| continuation to first token (s) | exact | error |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for side in res.get("sides", []):
        for r in side["rounds"]:
            lines.append(f"| {side['side']} | {r['prompt_tokens']} | {r.get('cached_tokens')} | {r['client_pause_s']} | "
                         f"{r['suspended_to_resubmitted_s']} | {r['resubmitted_to_first_token_s']} | {r['exact']} | "
                         f"{r['error'] or ''} |")
    lines += [""] + [f"- {s['side']}: median client pause {s['client_pause_median_s']} s, resumed {s['resumed']}, "
                     f"failed {s['resume_failed']}" for s in res.get("sides", [])] + [""]
    return lines

