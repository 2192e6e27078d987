#!/usr/bin/env bash
# Issue 30, session 14: one device call each, after bench/gpu_run.sh's set-up, on the 1b preset (EOS unreachable);
# results in $OUT/s14-MODE:
#     bash bench/gpu_run.sh -- bash bench/gpu_s14.sh MODE
#   cpu:     bench.worker_cpu on CPUs 0-3: a worker's main-thread CPU and wall time per function, per token at 1
#            stream and per step at 8 and 32, against stream_generate's (where the single stream's extra time goes,
#            and how much of a step the GIL is free inside MLX's launch)
#   siblings: bench.cpu_siblings: stream_generate pinned to CPU 0 (then CPU 8), a numpy spinner pinned to each other
#            CPU in turn: which vCPUs share a physical core (the VM says one thread per core)
#   isolate: bench.diagnose isolate, ROUNDS (12) interleaved rounds: the single stream's ITL of stream_generate on
#            CPUs 0-3 and on CPU 0, a worker on 0-3, a worker with its main thread alone on CPU 0 (others on 1-3), and
#            (from 6e3989d on) mlxsup serve over HTTP on 0-3, the harness on the other CPUs
#   targets: the profile's throughput section at 1, 8 and 32 clients, ROUNDS (7) interleaved rounds, servers on
#            CPUs 0-3, the harness on CLIENT_CPUS (default: every other CPU); with B=DIR (a checkout of another commit, carried in the tree) as mlxsup_b in the same rounds
set -u
MODE=${1:?cpu, siblings, isolate, targets or ramp}
source "$(dirname "$0")/gpu_1b.sh"
case $MODE in
  cpu)
    timeout 520 taskset -c 0-3 python3 -m bench.worker_cpu --model "$M" --out "$R/worker_cpu.json" \
      --streams "${STREAMS:-1,8,32}" --rounds "${ROUNDS:-5}" > "$R/log.txt" 2>&1
    echo "worker_cpu exit $? at ${SECONDS}s"; grep '\[worker_cpu\]' "$R/log.txt" ;;
  siblings)
    for c in 0 8; do
      timeout 250 python3 -m bench.cpu_siblings --model "$M" --out "$R/siblings-cpu$c.json" --cpu $c --repeat 2 \
        > "$R/log-cpu$c.txt" 2>&1
      echo "cpu $c: exit $? at ${SECONDS}s"; tail -1 "$R/log-cpu$c.txt"
    done ;;
  isolate)
    DIAG_ISOLATE_SIDES=${SIDES:-} timeout 520 python3 -m bench.diagnose --model "$M" --out "$R/isolate.json" --parts isolate \
      --rounds "${ROUNDS:-12}" > "$R/log.txt" 2>&1
    echo "isolate exit $? at ${SECONDS}s"; tail -c 1500 "$R/log.txt" ;;
  targets)
    rm -rf "$W/state-throughput" "$W/state-throughput-b"
    timeout 560 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-500}" \
      --sections throughput --concurrency "${CONC:-1,8,32}" --rounds "${ROUNDS:-7}" \
      ${CLIENT_CPUS:+--client-cpus "$CLIENT_CPUS"} ${B:+--mlxsup-b "$B"} > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md"
    sed -n '/^| clients | tok\/s mlxsup \/ mlxsup_b/,/^$/p' "$R/gpu/results.md" ;;
  ramp)  # session 16: the 32-client ramp as the worker saw it (its [admit] and [step] lines at DEBUG), 3 rounds
    rm -rf "$W/state-throughput"
    timeout 400 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-300}" \
      --sections throughput --concurrency 32 --rounds "${ROUNDS:-3}" --mlxsup-env MLXSUP_LOG_LEVEL=debug > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md"
    sed -n '/^| clients | side | ramp/,/^$/p' "$R/gpu/results.md"
    cp "$W"/state-throughput/logs/worker-*.log "$R/" 2>/dev/null
    grep -h '\[admit\]\|\[step\]' "$R"/worker-*.log | tail -60 ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
