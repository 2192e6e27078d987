#!/usr/bin/env bash
# Issue 15's closing GPU run, one device call after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_final.sh
# 1. the throughput section at 1, 8 and 32 clients, 3 rounds, default settings (the results in bench/results/gpu/);
# 2. the same at 8 and 32 clients, 1 round, with the batch-shape warm-up off: the configuration that crashed MLX CUDA
#    on a 2-GPU host before workers saw one GPU each (worker logs kept);
# 3. bench.diagnose worker,engine: a single stream's per-token time in-process, in a worker subprocess over bare
#    ZeroMQ, and split into feed / read / outside (worker/mlx_engine/solo.py SoloTimes).
# Everything lands in $OUT/final.tgz.
set -u
W=/tmp/bw R=/tmp/final
mkdir -p "$R"
timeout 280 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline 230 --sections throughput \
  --concurrency 1,8,32 --rounds 3 > "$R/gpu-log.txt" 2>&1
echo "throughput exit $?"; grep -A12 "^| target" "$R/gpu/results.md" | head -12
cp -r "$W/state-throughput/logs" "$R/logs-default" 2>/dev/null
printf '[server]\nwarm_batch_shapes = "off"\n' > /tmp/warmoff.toml
MLXSUP_CONFIG=/tmp/warmoff.toml timeout 150 python3 -m bench --profile gpu --out "$R/warmoff" --work "$W" --deadline 110 \
  --sections throughput --concurrency 8,32 --rounds 1 > "$R/warmoff-log.txt" 2>&1
echo "warmoff exit $?"; grep -h -c "cudaMemcpy" "$W"/state-throughput/logs/*.log
cp -r "$W/state-throughput/logs" "$R/logs-warmoff" 2>/dev/null
timeout 150 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag.json" --parts worker,engine --rounds 3 \
  > "$R/diag.log" 2>&1
echo "diagnose exit $?"; grep "^\[diagnose\]" "$R/diag.log" | cut -c1-2500
tar czf "$OUT/final.tgz" -C /tmp final; ls -la "$OUT"
