#!/usr/bin/env bash
# Issue 30, session 12: one device call each, after bench/gpu_run.sh's set-up, on the 1b preset (EOS unreachable);
# results in $OUT/s12-MODE:
#     bash bench/gpu_run.sh -- bash bench/gpu_s12.sh MODE
#   throughput: the profile's throughput section at 1, 8 and 32 clients, 5 interleaved rounds (the targets' run)
#   ramp:       32 clients, 3 rounds, the daemon and its worker at debug: the worker's [admit] and [step] lines
#               (each arrival burst, each ramp step's shape and time) next to the in-process side's TTFT
#   worker:     bench.diagnose ramp: 32 requests at once to a worker over bare ZeroMQ (no daemon) against bench.inproc
#   cpus:       32 clients, 3 rounds, with the servers on CPUs 0-3 and then 0-7 (CPU_SETS)
#   thrash:     bench.cuda_thrash: 600 new attention shapes under MLX's default environment and the worker's
#   ab:         BASE=DIR: this tree against DIR (mlxsup_b) in the same rounds, 1, 8 and 32 clients (CONC), 5 rounds
#   shapes:     bench.diagnose arrival (in-process BatchGenerator: 32 inserted at once vs 1-4 a step; first-seen
#               step shapes against seen ones) under MLX CUDA settings given as SHAPE_ENVS="name:K=V,K=V;..."
set -u
MODE=${1:?throughput, ramp or shapes}
source "$(dirname "$0")/gpu_1b.sh"
case $MODE in
  throughput)
    rm -rf "$W/state-throughput"
    timeout 540 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-480}" \
      --sections throughput --concurrency 1,8,32 --rounds "${ROUNDS:-5}" > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md" ;;
  ramp)
    rm -rf "$W/state-throughput"
    timeout 300 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline 240 \
      --sections throughput --concurrency 32 --rounds "${ROUNDS:-3}" --mlxsup-env MLXSUP_LOG_LEVEL=debug > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md"
    cp "$W"/state-throughput/logs/worker-*.log "$R/" 2>/dev/null
    grep -hE "\[admit\]|\[step\]" "$W"/state-throughput/logs/worker-bench*.log | sed 's/^.*\] //' | tail -n 60 ;;
  shapes)
    IFS=';' read -ra ENVS <<< "${SHAPE_ENVS:-default:}"
    for e in "${ENVS[@]}"; do
      name=${e%%:*} kv=${e#*:}
      MLXSUP_DIAG_ATTENTION=auto env $(tr ',' ' ' <<< "$kv") timeout 200 taskset -c 0-3 python3 -m bench.diagnose --model "$M" \
        --out "$R/arrival-$name.json" --parts arrival --rounds "${ROUNDS:-2}" > "$R/arrival-$name.log" 2>&1
      echo "$name ($kv) exit $? at ${SECONDS}s"
      python3 -c "import json; print(json.dumps(json.load(open('$R/arrival-$name.json'))['arrival']))"
    done ;;
  worker)
    timeout 400 python3 -m bench.diagnose --model "$M" --out "$R/ramp.json" --parts ramp --rounds "${ROUNDS:-5}" \
      > "$R/ramp.log" 2>&1
    echo "ramp exit $? at ${SECONDS}s"
    python3 -c "import json; d=json.load(open('$R/ramp.json'))['ramp']; print(json.dumps(d['median'])); print(json.dumps(d['per_round'])); [print(k, *v[-24:], sep='\n  ') for k, v in d['last_steps'].items()]" ;;
  cpus)  # the 32-client ramp with the servers on 4 CPUs and on 8: is mlxsup's extra TTFT its processes' CPU share?
    for c in ${CPU_SETS:-0-3 0-7}; do
      rm -rf "$W/state-throughput"
      timeout 280 python3 -m bench --profile gpu --out "$R/gpu-$c" --work "$W" --deadline 200 --sections throughput \
        --concurrency 32 --rounds "${ROUNDS:-3}" --server-cpus "$c" > "$R/log-$c.txt" 2>&1
      echo "server cpus $c: bench exit $? at ${SECONDS}s"; tables "$R/gpu-$c/results.md"
    done ;;
  thrash)  # MLX CUDA's cache-thrashing abort with MLX's default and with the worker's environment
    timeout 500 python3 -m bench.cuda_thrash --shapes "${SHAPES:-600}" 2>&1 | tee "$R/thrash.jsonl" ;;
  ab)  # this tree against another (BASE, a `git archive` of it: mlxsup_b) in the same rounds, 1, 8 and 32 clients
    rm -rf "$W/state-throughput" "$W/state-throughput-b"
    timeout 560 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-500}" \
      --sections throughput --concurrency "${CONC:-1,8,32}" --rounds "${ROUNDS:-5}" --mlxsup-b "${BASE:?a tree}" \
      > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md"
    sed -n '/^| clients | tok\/s mlxsup \/ mlxsup_b/,/^$/p' "$R/gpu/results.md" ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
