#!/usr/bin/env bash
# Issue 15's GPU run, one device call after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_final.sh [diag|cache]
# 1. the throughput section at 1, 8 and 32 clients, 3 rounds, default settings (the results in bench/results/gpu/);
# 2. diag: bench.diagnose engine,worker: a single stream's per-token time in-process (stream_generate, the Engine with
#    its solo steps compiled and uncompiled) and in a worker subprocess over bare ZeroMQ, split into feed / read /
#    outside (worker/mlx_engine/solo.py SoloTimes); on CPUs 0-3, as the throughput section's servers;
#    cache: bench/cache_bench.py, llama and qwen3_5 at 4k tokens (hot and SSD hits against cold TTFT);
#    cold: the cold start section (load + first token against in-process);
#    graphs: the throughput section again with MLX_USE_CUDA_GRAPHS=0 on every side (does MLX CUDA's graph capture
#    make the ramp's new batch shapes slow?);
#    cudnn: the throughput section again with MLX_CUDA_USE_CUDNN_SDPA=0 for mlxsup's workers only (cuDNN builds an
#    attention graph per new prefill shape); cudnn_diag: bench.diagnose cudnn (prefill shapes, long prefill speed,
#    arrivals, cuDNN on and off); long: bench.diagnose long (a 4194-token prompt's TTFT, Engine vs stream_generate).
# SKIP_THROUGHPUT=1 skips step 1.
# Everything lands in $OUT/final.tgz.
set -u
W=/tmp/bw R=/tmp/final
mkdir -p "$R"
if [ -z "${SKIP_THROUGHPUT:-}" ]; then
  timeout 260 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-220}" \
    --sections throughput --concurrency 1,8,32 --rounds 3 > "$R/gpu-log.txt" 2>&1
  echo "throughput exit $?"; sed -n '/^| clients | mlxsup \/ in-process/,/^$/p' "$R/gpu/results.md"
fi
cp -r "$W/state-throughput/logs" "$R/logs" 2>/dev/null
case "${1:-diag}" in
  diag)
    timeout 200 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag.json" --parts engine,worker \
      --rounds 3 > "$R/diag.log" 2>&1
    echo "diagnose exit $?"; grep "^\[diagnose\]" "$R/diag.log" | cut -c1-3000 ;;
  cold)
    timeout 230 python3 -m bench --profile gpu --out "$R/cold" --work "$W" --deadline 200 --sections cold_start \
      > "$R/cold-log.txt" 2>&1
    echo "cold exit $?"; grep "cold start" "$R/cold/results.md" | head -3; grep -h "\[warm\]" "$R"/logs/*.log | head -2 ;;
  graphs)
    MLX_USE_CUDA_GRAPHS=0 timeout 260 python3 -m bench --profile gpu --out "$R/gpu-nographs" --work "$W" --deadline 220 \
      --sections throughput --concurrency 1,8,32 --rounds 3 > "$R/gpu-nographs-log.txt" 2>&1
    echo "no graphs exit $?"; sed -n '/^| clients | mlxsup \/ in-process/,/^$/p' "$R/gpu-nographs/results.md" ;;
  cudnn)
    timeout 260 python3 -m bench --profile gpu --out "$R/gpu-nocudnn" --work "$W" --deadline "${TP_DEADLINE:-220}" \
      --sections throughput --concurrency 1,8,32 --rounds 3 --mlxsup-env MLX_CUDA_USE_CUDNN_SDPA=0 \
      > "$R/gpu-nocudnn-log.txt" 2>&1
    echo "mlxsup without cuDNN attention exit $?"; sed -n '/^| clients | mlxsup \/ in-process/,/^$/p' "$R/gpu-nocudnn/results.md"
    sed -n '/^| clients | side/,/^$/p' "$R/gpu/results.md" "$R/gpu-nocudnn/results.md" | grep -v "mlx_lm.server" ;;
  long)
    [ -d "$W/models/bench-1b" ] || python3 -m supervisor make-model --preset 1b "$W/models/bench-1b" > /dev/null
    timeout 200 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag-long.json" \
      --parts long --rounds 2 > "$R/diag-long.log" 2>&1
    echo "diagnose exit $?"; grep "^\[diagnose\]" "$R/diag-long.log" | cut -c1-6000 ;;
  cudnn_diag)
    timeout 300 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag-cudnn.json" \
      --parts cudnn --rounds 2 > "$R/diag-cudnn.log" 2>&1
    echo "diagnose exit $?"; grep "^\[diagnose\]" "$R/diag-cudnn.log" | cut -c1-3000 ;;
  cache)
    timeout 240 python3 bench/cache_bench.py --preset 1b --tokens 4096 --arch llama,qwen3_5 --out "$R/cache" \
      --work /tmp/cbw > "$R/cache-log.txt" 2>&1
    echo "cache exit $?"; grep "^| [lq]" "$R/cache/cache_bench.md"; grep -h "hit tokens" /tmp/cbw/*/logs/*.log 2>/dev/null | tail -8
    ;;
esac
tar czf "$OUT/final.tgz" -C /tmp final; ls -la "$OUT"
