#!/usr/bin/env bash
# Issue 15's diagnostics on the GPU host, one device call after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_diag.sh
# 1. the throughput section at 8 and 32 clients with the batch-shape warm-up off (the CUDA crash at 5abac84),
#    with every worker's log kept; 2. bench.diagnose engine + worker (where a single stream's per-token time
#    goes: in-process, the worker process over bare ZeroMQ, the whole daemon); 3. py-spy of daemon and worker.
# Everything lands in $OUT/diag.tgz (the device returns few files).
set -u
W=/tmp/bw R=/tmp/diag
mkdir -p "$R"
printf '[server]\nwarm_batch_shapes = "off"\n' > /tmp/warmoff.toml
MLXSUP_CONFIG=/tmp/warmoff.toml timeout 240 python3 -m bench --profile gpu --out "$R/warmoff" --work "$W" --deadline 170 \
  --sections throughput --concurrency "${DIAG_CONCURRENCY:-8,32}" --rounds 1 > "$R/warmoff.log" 2>&1
echo "warmoff exit $?"; grep -h -m3 -i "cudaMemcpy\|Traceback\|crash" "$W"/state-throughput/*.log "$W"/state-throughput/*/*.log 2>/dev/null
mkdir -p "$R/logs-warmoff" && cp -r "$W"/state-throughput/*.log "$W"/state-throughput/logs "$R/logs-warmoff/" 2>/dev/null
timeout 200 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag.json" --parts engine,worker --rounds 3 \
  > "$R/diag.log" 2>&1
echo "diagnose exit $?"; tail -c 3000 "$R/diag.log"
timeout 150 python3 -m bench --profile gpu --out "$R/prof" --work "$W" --deadline 100 --sections profile > "$R/prof.log" 2>&1
echo "profile exit $?"
tar czf "$OUT/diag.tgz" -C /tmp diag
ls -la "$OUT"
