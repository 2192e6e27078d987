#!/usr/bin/env bash
# Session 9's first GPU call (after bench/gpu_run.sh's set-up): a fresh Engine's first 30k-token prompt (issue 34: 64 s
# against 4.1 s cold in the same worker later) with its steps, then the throughput section at 1/8/32 streams, 5 rounds.
set -u
R=$OUT/s9diag; mkdir -p "$R"
python3 -m worker.mlx_engine.make_model /tmp/q1b --arch qwen3 --preset 1b > /dev/null 2>&1
python3 -c "import json; p='/tmp/q1b/config.json'; c=json.load(open(p)); c['max_position_embeddings']=65536; json.dump(c, open(p,'w'))"
timeout 240 taskset -c 0-3 python3 -c "import json; from bench.diagnose import part_long; print(json.dumps(part_long('/tmp/q1b', n=30000, rounds=1)))" > "$R/long30k.json" 2> "$R/long30k.log"
echo "long exit $?"; head -c 3000 "$R/long30k.json"; echo
timeout 330 python3 -m bench --profile gpu --out "$R/gpu" --work /tmp/bw --deadline 290 --sections throughput \
  --concurrency 1,8,32 --rounds 5 > "$R/gpu-log.txt" 2>&1
echo "throughput exit $?"; sed -n '/^| clients | side/,/^$/p;/^| clients | mlxsup \/ in-process/,/^$/p' "$R/gpu/results.md"
