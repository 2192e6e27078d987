#!/usr/bin/env bash
# Issue 30's single stream, session 11: one device call after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_s11.sh
# bench.itl_split on the 1b preset (EOS unreachable): stream_generate, the daemon over HTTP, the daemon's threads
# on other CPUs than its worker's, the daemon without a spare, and a worker over bare ZeroMQ (with and without the
# daemon's default caches), in the same interleaved rounds. Everything lands in $OUT/s11.
set -u
W=/tmp/bw R=$OUT/s11
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
timeout "${SPLIT_S:-420}" python3 -m bench.itl_split --model "$W/models/bench-1b" --out "$R" --rounds "${ROUNDS:-10}" \
  --tokens 256 --server-cpus 0-3 --apart-cpus 4-7 > "$R/log.txt" 2>&1
echo "itl_split exit $? at ${SECONDS}s"
tail -n 25 "$R/log.txt"
cp /tmp/itlsplit-*/daemon/logs/worker-bench-1b.log "$R/daemon-worker.log" 2>/dev/null
ls -la "$R"
