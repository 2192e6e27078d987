"""Vision: one image + a short prompt through the daemon against mlx-vlm in process, at 1 and 8 clients.

    python -m bench.vision --out bench/results/cpu/vision                        # the CPU box: a few minutes
    python -m bench.vision --profile gpu --out "$OUT/gpu/vision"                 # the GPU host (bench/gpu_run.sh --)
    python -m bench.vision --profile smoke --out /tmp/vision                     # seconds, no numbers

The model: a random-weight Qwen3-VL from `mlxsup make-model --arch qwen3_vl` at the profile's preset (offline), or
`--model DIR`. Every request carries its own random picture (the same pictures on both sides), so neither the
prompt caches nor the tower's kept output help mlxsup: this measures serving, not caching.
- **mlxsup**: one daemon serving the model, loaded before the clock; `c` clients each stream their share of the
  requests one after another (`stream_options.include_usage`); time to first token is to the first content delta.
- **mlx-vlm**: in this process, on the same folder: at 1 client `mlx_vlm.stream_generate` per request (time to
  first token is to its first result); at 8, `mlx_vlm.batch_generate` on 8 requests at a time (it reports no
  first token: the wall clock of the batch only).
Reported per level: median time to first token, decode tokens per second per request, and aggregate tokens per
second (all completion tokens over the wall clock); the ratios are mlxsup / mlx-vlm. Greedy both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import machine, write_json
from bench.servers import Mlxsup

MODEL_ID = "vl"
PROMPT = "Describe this picture in one sentence."
PROFILES: dict[str, dict] = {  # requests per concurrency level, picture side, max tokens, make-model preset
    "cpu": {"requests": {1: 4, 8: 16}, "side": 256, "max_tokens": 32, "preset": "tiny"},
    "gpu": {"requests": {1: 16, 8: 64}, "side": 512, "max_tokens": 128, "preset": "small"},
    "smoke": {"requests": {1: 1, 8: 8}, "side": 64, "max_tokens": 4, "preset": "tiny"},
}


def pictures(n: int, side: int) -> list[bytes]:
    from PIL import Image

    out = []
    for seed in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


async def one_stream(client: httpx.AsyncClient, url: str, image: bytes, max_tokens: int) -> dict:
    import base64

    body = {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
                {"type": "text", "text": PROMPT}]}]}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return {"ttft_s": first, "total_s": total, "tokens": tokens}


async def daemon_level(url: str, images: list[bytes], clients: int, max_tokens: int) -> dict:
    shares = [images[i::clients] for i in range(clients)]
    async with httpx.AsyncClient() as client:
        async def run(share: list[bytes]) -> list[dict]:
            return [await one_stream(client, url, img, max_tokens) for img in share]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run(s) for s in shares)) for r in rs]
        wall = time.perf_counter() - t0
    return summary(results, wall)


def summary(results: list[dict], wall: float) -> dict:
    ttfts = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    decode = [(r["tokens"] - 1) / (r["total_s"] - r["ttft_s"]) for r in results
              if r.get("ttft_s") is not None and r["tokens"] > 1 and r["total_s"] > r["ttft_s"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": round(wall, 4),
            "ttft_s_median": round(statistics.median(ttfts), 4) if ttfts else None,
            "decode_tok_s_median": round(statistics.median(decode), 2) if decode else None,
            "aggregate_tok_s": round(tokens / wall, 2) if wall else None}


def mlx_vlm_level(model: Path, images: list[bytes], clients: int, max_tokens: int) -> dict:
    from mlx_vlm import batch_generate, load, stream_generate
    from PIL import Image

    vlm, processor = load(str(model))
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
                                         tokenize=False, add_generation_prompt=True)
    pics = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    results = []
    t0 = time.perf_counter()
    if clients == 1:
        for pic in pics:
            s = time.perf_counter()
            first, n = None, 0
            for _ in stream_generate(vlm, processor, text, image=[pic], max_tokens=max_tokens, temperature=0.0):
                first = first if first is not None else time.perf_counter() - s
                n += 1
            results.append({"ttft_s": first, "total_s": time.perf_counter() - s, "tokens": min(n, max_tokens)})
    else:
        for i in range(0, len(pics), clients):
            group = pics[i:i + clients]
            s = time.perf_counter()
            out = batch_generate(vlm, processor, images=group, prompts=[text] * len(group), max_tokens=max_tokens)
            took = time.perf_counter() - s
            for t in out.texts:
                results.append({"ttft_s": None, "total_s": took, "tokens": len(tokenizer.encode(t))})
    return summary(results, time.perf_counter() - t0)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="a Qwen3-VL or Gemma 3 folder (default: make-model's)")
    args = ap.parse_args()
    prof = PROFILES[args.profile]
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    root = work / "models"
    model = args.model
    if model is None:
        from worker.mlx_engine.make_model import make_model

        model = root / MODEL_ID
        make_model(model, prof["preset"], arch="qwen3_vl")
    else:
        root.mkdir(parents=True)
        (root / MODEL_ID).symlink_to(model.resolve())
    images = pictures(max(prof["requests"].values()), prof["side"])
    levels: dict = {}
    server = Mlxsup(root, work / "state")
    await server.start()
    try:
        async with httpx.AsyncClient() as client:
            await server.load(client, MODEL_ID)
            await one_stream(client, server.chat_url, pictures(1, prof["side"])[0], 2)  # first-use costs
        for c, n in prof["requests"].items():
            levels[str(c)] = {"mlxsup": await daemon_level(server.chat_url, images[:n], c, prof["max_tokens"])}
    finally:
        stopped = await server.stop()
    for c, n in prof["requests"].items():
        mlx_vlm_level(model, images[:1], 1, 2)  # its first-use costs too
        levels[str(c)]["mlx_vlm"] = mlx_vlm_level(model, images[:n], c, prof["max_tokens"])
        a, b = levels[str(c)]["mlxsup"], levels[str(c)]["mlx_vlm"]
        levels[str(c)]["ratio"] = {k: round(a[k] / b[k], 3) if a.get(k) and b.get(k) else None
                                   for k in ("ttft_s_median", "decode_tok_s_median", "aggregate_tok_s")}
    result = {"bench": "vision", "profile": args.profile, "preset": prof["preset"], "side": prof["side"],
              "max_tokens": prof["max_tokens"], "levels": levels, "daemon_stopped": stopped, "machine": machine()}
    write_json(args.out / f"vision-{args.profile}.json", result)
    print(json.dumps(levels, indent=1))
    return 0 if all(v == "gone" for v in stopped["pids"].values()) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
