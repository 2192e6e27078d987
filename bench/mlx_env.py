"""Issue 30: MLX's own settings (environment variables read at import) against the single stream's ITL.

    python -m bench.mlx_env --model DIR --out DIR [--rounds 8] [--tokens 256] [--cpus 0-3] \
        --variants "default;ops60:MLX_MAX_OPS_PER_BUFFER=60;nographs:MLX_USE_CUDA_GRAPHS=0"

One stream_generate process per variant (bench/inproc.py, pinned to `--cpus`), all alive at once and driven one at a
time in interleaved rounds (the order rotated, reversed every other round): ITL p50 per variant and round, and each
round's ratio to the first variant. On MLX CUDA every eval records its kernels into CUDA graphs of at most
MLX_MAX_OPS_PER_BUFFER nodes (default 20); a decode step of the 1b preset is ~260 nodes, so its CPU time depends on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench import servers
from bench.common import percentile
from bench.diagnose import itl_ms
from bench.prompts import prompts


class EnvInProc(servers.InProc):
    def __init__(self, model_dir: Path, log_path: Path, env: dict[str, str]) -> None:
        super().__init__(model_dir, log_path)
        self.env = env

    def _spawn(self, argv: list[str], env: dict | None = None, **kw) -> None:
        super()._spawn(argv, {**(env or {}), **self.env}, **kw)


def parse_variants(spec: str) -> dict[str, dict[str, str]]:
    """'NAME[:K=V[,K=V]];...' -> {NAME: {K: V}}."""
    out = {}
    for part in filter(None, spec.split(";")):
        name, _, env = part.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in filter(None, env.split(",")))
    return out



async def main_async(args: argparse.Namespace) -> dict:
    variants = parse_variants(args.variants)
    tmp = Path(tempfile.mkdtemp(prefix="mlxenv-"))
    servers.SERVER_CPUS = servers.parse_cpus(args.cpus)
    procs = {name: EnvInProc(Path(args.model), tmp / f"{name}.log", env) for name, env in variants.items()}
    rounds: list[dict] = []
    try:
        for p in procs.values():
            await p.start()
        names = list(procs)
        for name in names:
            await procs[name].run("stream", [prompts("warm", 1, 24, 0)[0]], args.tokens, 300)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            if r % 2:
                order.reverse()
            msgs = prompts(f"r{r}", 1, 24, 0)[0]
            row = {}
            for name in order:
                rec = await procs[name].run("stream", [msgs], args.tokens, 300)
                row[name] = itl_ms(rec["records"][0]["times"])
            rounds.append(row)
            print(json.dumps({"round": r, **row}), flush=True)
    finally:
        for p in procs.values():
            await p.stop()
    base = next(iter(variants))
    summary = {name: {"env": env, "itl_p50_ms_median": percentile([r[name] for r in rounds], 50),
                      "ratio_to_first_median": round(percentile([r[name] / r[base] for r in rounds], 50), 3),
                      "per_round": [r[name] for r in rounds]} for name, env in variants.items()}
    results = {"meta": {"model": args.model, "cpus": args.cpus, "tokens": args.tokens, "rounds": args.rounds},
               "rounds": rounds, "summary": summary}
    return results


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mlx_env")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--cpus", default="0-3")
    p.add_argument("--variants", default="default;ops60:MLX_MAX_OPS_PER_BUFFER=60;nographs:MLX_USE_CUDA_GRAPHS=0")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = asyncio.run(main_async(args))
    Path(args.out, "mlx_env.json").write_text(json.dumps(results, indent=1))
    for name, s in results["summary"].items():
        print(f"{name:12s} {s['env']} ITL p50 {s['itl_p50_ms_median']} ms, / {next(iter(results['summary']))} "
              f"{s['ratio_to_first_median']}  {s['per_round']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
