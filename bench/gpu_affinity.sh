#!/usr/bin/env bash
# Is a process's single-stream speed on the GPU host a matter of the CPUs it runs on? After bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_affinity.sh
set -u
W=/tmp/bw
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
timeout 400 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$OUT/affinity.json" --parts affinity --rounds 3 2>&1 \
  | grep -v Warning | tail -c 4000
