#!/usr/bin/env bash
# Session 10's GPU call (after bench/gpu_run.sh's set-up): a lone request on a sliding-window or recurrent model with
# the prompt caches on, as the solo (1fac618: its prefill stops at the snapshot points) against the BatchGenerator at
# batch 1 (--solo off: where such a request always went before), beside stream_generate in a process of its own,
# each a real worker subprocess over ZeroMQ (bench.diagnose's `worker` part), 5 rounds of 256 tokens, 1b preset:
#     bash bench/gpu_run.sh -- bash bench/gpu_session10.sh
# -> $OUT/gpu/snapshot-solo/<family>.json. A dry run on a CPU: OUT=/tmp/o PRESET=tiny PY=.venv/bin/python bash ...
set -u
R=$OUT/gpu/snapshot-solo W=${WORK:-/tmp/s10w} PY=${PY:-python3}
mkdir -p "$R" "$W"
for family in ${FAMILIES:-qwen3_5 gemma3}; do
  timeout 120 "$PY" -m worker.mlx_engine.make_model "$W/$family" --arch "$family" --preset "${PRESET:-1b}" \
    > "$R/$family-make.log" 2>&1
  timeout -k 10 "${EACH_S:-200}" taskset -c 0-3 "$PY" -m bench.diagnose --model "$W/$family" --parts worker \
    --words 80 --worker-variants W_caches,W_caches_solo_off --rounds 5 --out "$R/$family.json" > "$R/$family.log" 2>&1
  echo "$family exit $? at ${SECONDS}s"
  "$PY" - "$R/$family.json" <<'PY'
import json, sys
w = json.load(open(sys.argv[1])).get("worker", {})
for k, v in w.items():
    if isinstance(v, dict):
        print(k, "ITL p50 ms", v.get("itl_p50_ms_median"), "per round", v.get("itl_p50_ms_per_round"),
              "tok/s", v.get("tok_s_after_first_per_round"), v.get("error", ""))
PY
done
