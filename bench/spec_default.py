"""Does mlxsup's default configuration decode faster than in-process mlx-lm where drafting pays, and cost nothing
where it does not? One run, every side on the same model and prompts.

    python -m bench.spec_default --demo --rounds 3 --out DIR              # SmolLM2-135M-Instruct (serve --demo's)
    python -m bench.spec_default --model DIR --rounds 3 --out DIR         # any model folder
    python -m bench.spec_default --demo --max-tokens 64 --rounds 1 --warmup-tokens 0 --out DIR   # a CPU smoke
    bash bench/gpu_run.sh -- python3 -m bench.spec_default --model DIR --rounds 3 --out "$OUT"/spec_default
    #   on the GPU host, where no registry is reachable: DIR is the demo imported elsewhere
    #   (`python -m worker.mlx_engine.gguf_import --demo DIR`, what `--demo` runs) and copied there

Two prompts, greedy, the same `--max-tokens` everywhere, EOS kept (each side stops where the model does):
`copy` asks for a ~30-line module back with one name renamed (bench/speculative.py's ASK: prompt lookup's case),
`chat` for a short story (less to look up: `acceptance` says how much). The sides:
- `inproc`: mlx-lm's `stream_generate` in a process of its own (bench/inproc.py),
- `default`, `off`, `prompt-lookup`: one mlxsup daemon serving the model under three ids, `[models.ID]` entries
  that leave `speculative` out (whatever the daemon does by default), set it "off", set it "prompt-lookup",
- `mlx_lm`: mlx_lm.server.
Each round runs every side on each prompt, the sides' order reversed every other round (after one untimed warm-up
per side and prompt: first kernels, drafting's pricing). Per run: decode tokens/s (the side's generated tokens after
the first over the time from the first content to the last; an EOS is no token), TTFT, and for mlxsup the drafted
and kept tokens of its usage (`completion_tokens_details`). Ratios are medians of per-round ratios, with their
spread; `parity` per side says its text equalled the reference's (in-process where it ran) in every run.
Invariants: every server listens on 127.0.0.1; every process started is stopped in a `finally` and proved gone
(bench/servers.py); no round starts after `--deadline` seconds; every request has `--timeout`.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import client as cl
from bench.common import machine, median, write_json
from bench.servers import InProc, Managed, MlxLmServer, Mlxsup
from bench.speculative import ASK, acceptance, demo_model, spread

SIDES = ("inproc", "default", "off", "prompt-lookup", "mlx_lm")
MODES = {"default": None, "off": "off", "prompt-lookup": "prompt-lookup"}  # `speculative` of each entry; None: none
# SmolLM2-135M's greedy 400 tokens loop on most chat prompts; of those tried, this one's repeat least (a 3-gram
# lookup predicted 25 % of them, against 47 % for a lighthouse keeper's story alone and 82 % for a fridge explained)
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = {"copy": ASK, "chat": CHAT}
PAIRS = (("default", "inproc"), ("off", "inproc"), ("prompt-lookup", "inproc"), ("mlx_lm", "inproc"),
         ("default", "off"), ("prompt-lookup", "off"), ("default", "mlx_lm"))
# (prompt, side, over, at least, where it is a target): issue 52's headline targets
TARGETS = (("copy", "default", "inproc", 2.0, "gpu"), ("chat", "default", "off", 0.97, "any"),
           ("copy", "prompt-lookup", "off", 2.0, "gpu"))


def model_id(side: str) -> str:
    return f"spec-{side}"


def config(model: Path) -> str:
    """The daemon's config: the model once per mlxsup side, `speculative` as MODES says."""
    out = []
    for side, mode in MODES.items():
        out.append(f'[models.{model_id(side)}]\npath = "{model}"\n' + (f'speculative = "{mode}"\n' if mode else ""))
    return "\n".join(out)


def measured(times: list[float], tokens: int, text: str, drafted: int = 0, accepted: int = 0) -> dict:
    """One run's figures: `times` are the content's arrivals (s from the send), `tokens` the side's own count."""
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"tokens": tokens, "ttft_ms": times[0] * 1e3 if times else None,
            "decode_tok_s": (tokens - 1) / span if tokens > 1 and span > 0 else None,
            "drafted": drafted, "accepted": accepted, "text": text}


def from_inproc(rec: dict) -> dict:
    """stream_generate's record: an EOS's yield (finish_reason "stop") carries no token, so it is dropped."""
    times = rec["times"][:-1] if rec.get("finish_reason") == "stop" else rec["times"]
    return measured(times, len(times), rec["text"])


def from_http(rec: dict) -> dict:
    """A streamed chat completion's record (bench/client.py, its text kept): tokens and drafts from its usage."""
    if rec["error"] or not rec["times"] or not rec["usage"]:
        raise RuntimeError(f"the request failed: {rec['error'] or 'no content or no usage in the stream'}")
    details = rec["usage"].get("completion_tokens_details") or {}
    accepted = details.get("accepted_prediction_tokens", 0)
    return measured(rec["times"], rec["usage"]["completion_tokens"], "".join(rec["parts"]),
                    accepted + details.get("rejected_prediction_tokens", 0), accepted)


def ratios(rounds: list[dict], prompt: str, a: str, b: str) -> dict | None:
    """a's decode tokens/s over b's, per round where both ran: the median and the spread."""
    per = [r[prompt][a]["decode_tok_s"] / r[prompt][b]["decode_tok_s"] for r in rounds
           if all((r.get(prompt, {}).get(s) or {}).get("decode_tok_s") for s in (a, b))]
    return {"p50": round(median(per), 4), "spread": spread(per), "rounds": len(per)} if per else None


def summarize(rounds: list[dict], prompts: list[str], sides: list[str]) -> dict:
    """Per prompt: each side's speed, TTFT, tokens, drafts and parity with the reference; the PAIRS' ratios."""
    out: dict = {}
    for prompt in prompts:
        runs = {s: [r[prompt][s] for r in rounds if s in r.get(prompt, {})] for s in sides}
        ref_side = "inproc" if runs.get("inproc") else next((s for s in sides if runs[s]), None)
        ref = runs[ref_side][0]["text"] if ref_side else None
        per: dict = {}
        for side, xs in runs.items():
            if not xs:
                continue
            tps = [x["decode_tok_s"] for x in xs if x["decode_tok_s"]]
            per[side] = {"decode_tok_s_p50": median(tps), "decode_tok_s_spread": spread(tps) if tps else None,
                         "ttft_ms_p50": median([x["ttft_ms"] for x in xs]), "tokens": sorted({x["tokens"] for x in xs}),
                         "drafted": sum(x["drafted"] for x in xs), "accepted": sum(x["accepted"] for x in xs),
                         "acceptance": acceptance(xs), "parity": all(x["text"] == ref for x in xs), "runs": len(xs)}
        pairs = {f"{a}/{b}": ratios(rounds, prompt, a, b) for a, b in PAIRS if a in sides and b in sides}
        out[prompt] = {"reference": ref_side, "sides": per, "ratios": {k: v for k, v in pairs.items() if v}}
    return out


def targets(summary: dict, gpu: bool) -> list[dict]:
    """TARGETS against the summary: met True / False, None where not measured or not a target on this device."""
    rows = []
    for prompt, a, b, least, where in TARGETS:
        r = summary.get(prompt, {}).get("ratios", {}).get(f"{a}/{b}")
        applies = where == "any" or gpu
        rows.append({"what": f"{a}/{b} on {prompt}", "target": least, "p50": r["p50"] if r else None,
                     "spread": r["spread"] if r else None, "applies": applies,
                     "met": (r["p50"] >= least) if r and applies else None})
    return rows


def markdown(result: dict) -> str:
    def num(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    m = result["machine"]
    lines = [f"`{result['command']}`", "",
             f"mlxsup {m['git']['commit'] or m.get('tree') or '(no git here)'}{' (dirty)' if m['git']['dirty'] else ''}; "
             f"MLX device {result['device']}; "
             f"{m['cpu_model']}, {m['logical_cores']} cores{'; ' + ', '.join(m['gpus']) if m['gpus'] else ''}; "
             f"{result['rounds_run']} interleaved rounds, max_tokens {result['max_tokens']}, greedy; "
             f"model {result['model']}", ""]
    if result.get("drafting"):
        lines += ["mlxsup's drafting per side (its /api/status): " + ", ".join(
            f"{side} {mode}" for side, mode in result["drafting"].items()), ""]
    for prompt, s in result["summary"].items():
        lines += [f"**{prompt}** (parity against {s['reference']})", "",
                  "| side | decode tok/s p50 [spread] | TTFT ms p50 | tokens | drafted / kept (acceptance) | parity |",
                  "|---|---|---|---|---|---|"]
        for side, x in s["sides"].items():
            sp = x["decode_tok_s_spread"] or [None, None]
            lines.append(f"| {side} | {num(x['decode_tok_s_p50'], 1)} [{num(sp[0], 1)}-{num(sp[1], 1)}] | "
                         f"{num(x['ttft_ms_p50'], 0)} | {'/'.join(map(str, x['tokens']))} | {x['drafted']} / "
                         f"{x['accepted']} ({num(x['acceptance'], 3)}) | {x['parity']} |")
        lines += ["", "| ratio | p50 [spread] |", "|---|---|"]
        lines += [f"| {k} | {num(v['p50'], 3)} [{num(v['spread'][0], 3)}-{num(v['spread'][1], 3)}] |"
                  for k, v in s["ratios"].items()]
        lines.append("")
    lines += ["| target | at least | p50 [spread] | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        sp = t["spread"] or [None, None]
        met = t["met"] if t["applies"] else "not a target on a CPU"
        lines.append(f"| {t['what']} | {t['target']} | {num(t['p50'], 3)} [{num(sp[0], 3)}-{num(sp[1], 3)}] | {met} |")
    lines += ["", f"every process gone: {result['all_processes_gone']}"]
    return "\n".join(lines) + "\n"


def mlx_device() -> str:
    out = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "unknown"


class Sides:
    """The processes behind the sides and one run of a side on a prompt."""

    def __init__(self, model: Path, work: Path, sides: list[str], timeout: float) -> None:
        (work / "no-models").mkdir(parents=True, exist_ok=True)
        cfg = work / "config.toml"
        cfg.write_text(config(model))
        self.sides, self.timeout = sides, timeout
        self.inproc = InProc(model, work / "logs" / "inproc.log")
        self.daemon = Mlxsup(work / "no-models", work / "state", args=["--config", str(cfg)])
        self.mlxlm = MlxLmServer(model, work / "logs" / "mlx_lm_server.log")
        self.procs: dict[str, Managed] = {
            name: p for name, p, used in (("inproc", self.inproc, "inproc" in sides),
                                          ("mlxsup", self.daemon, any(s in MODES for s in sides)),
                                          ("mlx_lm.server", self.mlxlm, "mlx_lm" in sides)) if used}

    async def start(self, http: httpx.AsyncClient, gpu: bool) -> dict:
        """Every process up, each mlxsup model loaded (and, on a GPU, past its idle warm-up): the load's facts."""
        await asyncio.gather(*(p.start() for p in self.procs.values()))
        loaded: dict = {}
        for side in (s for s in self.sides if s in MODES):
            loaded[side] = await self.daemon.load(http, model_id(side))
            if gpu:
                loaded[side]["warm_up_s"] = await self.daemon.warmed_up(model_id(side), timeout=120)
        self.daemon.track()
        return loaded

    async def run(self, side: str, prompt: str, max_tokens: int) -> dict:
        messages = [{"role": "user", "content": PROMPTS[prompt]}]
        if side == "inproc":
            return from_inproc((await self.inproc.run("stream", [messages], max_tokens, self.timeout))["records"][0])
        url, model = ((self.mlxlm.chat_url, "default_model") if side == "mlx_lm"
                      else (self.daemon.chat_url, model_id(side)))
        rec = await cl.stream_chat(url, cl.chat_body(model, messages, max_tokens), self.timeout,
                                   rec=cl.new_record(text=True))
        return from_http(rec)

    async def stop(self) -> dict:
        return {name: await p.stop() for name, p in self.procs.items()}


async def run(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    model = (args.model or demo_model(args.work)).resolve()
    device = mlx_device()
    gpu = "gpu" in device
    sides = Sides(model, args.work, args.sides, args.timeout)
    result: dict = {"command": "python -m bench.spec_default " + shlex.join(args.argv), "machine": machine(),
                    "device": device, "model": str(model), "sides": args.sides, "prompts": args.prompts,
                    "chat_prompt": CHAT, "max_tokens": args.max_tokens, "rounds": args.rounds, "runs": []}
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            result["loaded"] = await sides.start(http, gpu)
            for prompt in args.prompts if args.warmup_tokens else []:
                for side in args.sides:
                    await sides.run(side, prompt, args.warmup_tokens)
            for r in range(args.rounds):
                if time.monotonic() - t0 > args.deadline:
                    result["stopped_at_deadline"] = r
                    break
                order = args.sides if r % 2 == 0 else args.sides[::-1]
                row: dict = {"order": order}
                for prompt in args.prompts:
                    row[prompt] = {side: await sides.run(side, prompt, args.max_tokens) for side in order}
                    print(f"round {r} {prompt}: " + ", ".join(
                        f"{s} {x['decode_tok_s'] or 0:.1f} tok/s" for s, x in row[prompt].items()), flush=True)
                result["runs"].append(row)
            result["status"] = {s: await sides.daemon.model(http, model_id(s)) for s in args.sides if s in MODES}
            result["drafting"] = {s: st.get("drafting") for s, st in result["status"].items()}
    except Exception as exc:  # keep what was measured
        result["error"] = repr(exc)
    finally:
        result["cleanup"] = await sides.stop()
    result["all_processes_gone"] = all(v == "gone" for c in result["cleanup"].values() for v in c["pids"].values())
    result["rounds_run"] = len(result["runs"])
    result["summary"] = summarize(result["runs"], args.prompts, args.sides)
    result["targets"] = targets(result["summary"], gpu)
    result["texts"] = {p: next(iter(result["runs"][0][p].values()))["text"] for p in args.prompts} if result["runs"] \
        else {}
    for row in result["runs"]:  # the texts once, in "texts"; parity is in the summary
        for prompt in args.prompts:
            for x in row[prompt].values():
                x.pop("text")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.spec_default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model folder")
    p.add_argument("--demo", action="store_true", help="SmolLM2-135M-Instruct, imported as `serve --demo` does")
    p.add_argument("--out", type=Path, required=True, help="a folder: spec_default.json and spec_default.md")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mlxsup-bench-spec-default")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--prompts", default=",".join(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--warmup-tokens", type=int, default=None, help="each side's untimed run (default: --max-tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    p.add_argument("--deadline", type=float, default=3000.0, help="no round starts after this many seconds")
    args = p.parse_args(argv)
    if not (args.model or args.demo):
        p.error("--model DIR or --demo")
    args.argv = argv
    args.sides = args.sides.split(",")
    args.prompts = args.prompts.split(",")
    if unknown := sorted(set(args.sides) - set(SIDES)) + sorted(set(args.prompts) - set(PROMPTS)):
        p.error(f"unknown side or prompt: {unknown}")
    args.warmup_tokens = args.max_tokens if args.warmup_tokens is None else args.warmup_tokens
    result = asyncio.run(run(args))
    write_json(args.out / "spec_default.json", result)
    md = markdown(result)
    (args.out / "spec_default.md").write_text(md)
    print(md)
    return 0 if result["all_processes_gone"] and "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
