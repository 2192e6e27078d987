"""The ceiling: mlx-lm in-process, no server. A subprocess driven by the harness over stdin/stdout.

    python -m bench.inproc --model DIR            # persistent: JSON commands on stdin, one JSON line out each
    python -m bench.inproc --model DIR --cold M   # one cold start: load + first token for messages M, then exit

Commands: {"op": "run", "mode": "stream"|"batch", "messages": [[...], ...], "max_tokens": N}
  stream: mlx_lm.stream_generate, one request (the single-stream ceiling); its record also has the text and the
          finish_reason
  batch:  mlx_lm BatchGenerator (completion_batch_size 32, prefill_batch_size 8, as mlxsup's worker), all
          requests inserted at once, stepped until every one has max_tokens tokens.
Each request's record holds token arrival times relative to its start (the tokenizer call included, as a
server's time to first token includes tokenizing), so the harness computes every side's statistics alike.
Sampling is greedy on every side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

T_START = time.perf_counter()


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inproc")
    p.add_argument("--model", required=True)
    p.add_argument("--cold", default=None, help="JSON messages: measure one cold start and exit")
    p.add_argument("--prefill-step-size", type=int, default=512)
    args = p.parse_args()

    t_imp = time.perf_counter()
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    import_s = time.perf_counter() - t_imp
    greedy = make_sampler(0.0)

    if args.cold is not None:
        messages = json.loads(args.cold)
        t0 = time.perf_counter()
        model, tok = load(args.model)
        t_loaded = time.perf_counter()
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        for _ in stream_generate(model, tok, prompt, max_tokens=1, sampler=greedy):
            t1 = time.perf_counter()
            break
        emit({"import_s": import_s, "load_s": t_loaded - t0, "first_token_after_load_s": t1 - t_loaded,
              "load_plus_first_token_s": t1 - t0, "interpreter_to_first_token_s": t1 - T_START,
              "device": str(mx.default_device())})
        return 0

    t0 = time.perf_counter()
    model, tok = load(args.model)
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8,
                         prefill_step_size=args.prefill_step_size)
    emit({"ready": True, "load_s": time.perf_counter() - t0, "import_s": import_s,
          "device": str(mx.default_device()), "eos_token_ids": sorted(tok.eos_token_ids)})

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            if cmd["mode"] == "stream":
                out = run_stream(model, tok, cmd, greedy, stream_generate)
            else:
                out = run_batch(gen, tok, cmd)
            emit({"ok": True, **out})
        except Exception as exc:  # report, keep serving
            emit({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    gen.close()
    return 0


def run_stream(model, tok, cmd: dict, sampler, stream_generate) -> dict:
    records = []
    for messages in cmd["messages"]:
        t0 = time.perf_counter()
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        times, text, finish = [], [], None
        for r in stream_generate(model, tok, prompt, max_tokens=cmd["max_tokens"], sampler=sampler):
            times.append(time.perf_counter() - t0)
            text.append(r.text)
            finish = r.finish_reason
        # an EOS ends the stream with one more yield (its time, no token of the text): "finish_reason" says so
        records.append({"start": 0.0, "times": times, "completion_tokens": len(times), "prompt_tokens": len(prompt),
                        "text": "".join(text), "finish_reason": finish})
    return {"records": records}


def run_batch(gen, tok, cmd: dict) -> dict:
    """All requests inserted at once; each token detokenized (streaming BPE, one detokenizer per request, as
    every text-serving side must), so the ceiling produces text like the servers do."""
    n = cmd["max_tokens"]
    t0 = time.perf_counter()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in cmd["messages"]]
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    times: dict[int, list[float]] = {u: [] for u in uids}
    detok = {u: tok.detokenizer for u in uids}
    chars = dict.fromkeys(uids, 0)
    left = set(uids)
    steps = 0
    while left:
        _, responses = gen.next()
        steps += 1
        for r in responses:
            if r.uid in times:
                d = detok[r.uid]
                d.add_token(r.token)
                if r.finish_reason is not None:
                    d.finalize()
                    left.discard(r.uid)
                chars[r.uid] += len(d.last_segment)
                times[r.uid].append(time.perf_counter() - t0)
    return {"records": [{"start": 0.0, "times": times[u], "completion_tokens": len(times[u]),
                         "prompt_tokens": len(p)} for u, p in zip(uids, prompts)], "steps": steps}


if __name__ == "__main__":
    sys.exit(main())
