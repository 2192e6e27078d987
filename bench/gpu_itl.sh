#!/usr/bin/env bash
# Issue 30's single-stream diagnosis (session 10), one device call after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_itl.sh
# 1. bench.diagnose worker on CPUs 0-3: stream_generate in a subprocess against a worker over bare ZeroMQ (no daemon, no
#    HTTP), as shipped and with the daemon's default caches, each with py-spy (DIAG_PYSPY) and the solo's SoloTimes;
# 2. the throughput section at 1 and 32 clients, 4 rounds, with the harness pinned off the servers' CPUs
#    (client_cpus rest), then the profile section (py-spy on the daemon and the worker under 1 and 32 clients).
# Everything lands in $OUT/itl.tgz.
set -u
R=/tmp/itl W=/tmp/bw
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
DIAG_PYSPY=$R/spy DIAG_WORKER_VARIANTS=${VARIANTS:-W_plain,W_daemon_caches,W_attention_fast} timeout 200 \
  taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/worker.json" --parts worker --rounds 3 \
  > "$R/worker.log" 2>&1
echo "worker diag exit $? at ${SECONDS}s"; grep '^\[diagnose\]' "$R/worker.log" | cut -c1-5000
timeout 290 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-250}" \
  --sections throughput,profile --concurrency 1,32 --rounds "${ROUNDS:-4}" > "$R/gpu-log.txt" 2>&1
echo "bench exit $? at ${SECONDS}s"
sed -n '/^| clients | side/,/^$/p;/^| clients | mlxsup \/ in-process/,/^$/p;/^| clients | ITL/,/^$/p' "$R/gpu/results.md"
cp -r "$W/state-throughput/logs" "$R/logs" 2>/dev/null
tar czf "$OUT/itl.tgz" -C /tmp itl; ls -la "$OUT"
