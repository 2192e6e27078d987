#!/usr/bin/env bash
# Issue 30, session 11, fifth call: generate_step, the worker's Solo alone and the whole Engine, one process, CPUs 0-3.
#     bash bench/gpu_run.sh -- bash bench/gpu_s11e.sh
set -u
W=/tmp/bw R=$OUT/s11e
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
timeout 200 taskset -c 0-3 python3 -m bench.solo_vs_sg --model "$W/models/bench-1b" --rounds "${ROUNDS:-14}" ${COMPILED:+--compiled} > "$R/log.txt" 2>&1
echo "solo_vs_sg exit $? at ${SECONDS}s"
grep '^{' "$R/log.txt"
