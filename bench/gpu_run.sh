#!/usr/bin/env bash
# The GPU run on the device host (no package registry there). From the repo root, after a first
# device call that copied .mlx-cuda/pa/* to /tmp/mlxpkg (see ../shared/device/README.md), in a
# second call carrying .mlx-cuda/pb and .whl (pyzmq, starlette, uvicorn, py-spy wheels for cp312):
#     bash bench/gpu_run.sh [extra python -m bench args]      the full GPU profile
#     bash bench/gpu_run.sh -- COMMAND ...                     any command, after the same set-up
#     BENCH_MODEL=1b bash bench/gpu_run.sh -- COMMAND ...      the same with $M: the preset's model, EOS unreachable
#     bash bench/gpu_run.sh group [bench/group_bench.py args]  a 2-rank NCCL worker group vs one GPU (2 GPUs)
# CARRY=DIR: where .mlx-cuda/pb and .whl are, when running from a snapshot of the tree (default: .).
# Results go to $OUT/gpu (results.json, results.md, chart.png, profiles) and the log to $OUT/gpu-log.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site "$OUT"
if [ ! -f /tmp/site/.unpacked ]; then
  cat /tmp/mlxpkg/site.xz.aa "${CARRY:-.}"/.mlx-cuda/pb/site.xz.ab | xz -d | tar x -C /tmp/site && touch /tmp/site/.unpacked || exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${CARRY:-.}"/.whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -c "import mlx.core as mx, mlx_lm, zmq, uvicorn, starlette; print(mx.default_device(), mx.__version__)" || exit 5
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
if [ -n "${BENCH_MODEL:-}" ]; then  # a make-model preset: its view with EOS unreachable (bench/model.py) in $M, made once
  export M=/tmp/bw/models/bench-$BENCH_MODEL
  [ -e "$M/model.safetensors" ] || rm -rf "$M"
  [ -d "$M" ] || python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('/tmp/bw/source/$BENCH_MODEL'), '$BENCH_MODEL', 0), Path('$M'))" > /dev/null || exit 6
fi
if [ "${1:-}" = "--" ]; then shift; exec "$@"; fi
if [ "${1:-}" = "group" ]; then  # a 2-rank worker group over both GPUs (NCCL) vs one GPU
  shift
  export NCCL_NVLS_ENABLE=0
  python3 -m bench.group_bench --backend nccl --preset 1b --out "$OUT/group" --work /tmp/gbw "$@" 2>&1 | tee "$OUT/group-log.txt"
  exit "${PIPESTATUS[0]}"
fi
python3 -m bench --profile gpu --out "$OUT/gpu" --work /tmp/bw --deadline "${DEADLINE:-470}" "$@" 2>&1 | tee "$OUT/gpu-log.txt"
