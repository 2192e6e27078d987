#!/usr/bin/env bash
# Issue 30, session 11, third call: MLX CUDA's graph settings against the single stream's ITL.
#     bash bench/gpu_run.sh -- bash bench/gpu_s11c.sh
set -u
W=/tmp/bw R=$OUT/s11c
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
timeout 300 python3 -m bench.mlx_env --model "$W/models/bench-1b" --out "$R" --rounds "${ROUNDS:-10}" --cpus 0-3 \
  --variants "${VARIANTS:-default;ops10:MLX_MAX_OPS_PER_BUFFER=10;ops60:MLX_MAX_OPS_PER_BUFFER=60;ops250:MLX_MAX_OPS_PER_BUFFER=250;nographs:MLX_USE_CUDA_GRAPHS=0;nographs_ops250:MLX_USE_CUDA_GRAPHS=0,MLX_MAX_OPS_PER_BUFFER=250}" \
  > "$R/log.txt" 2>&1
echo "mlx_env exit $? at ${SECONDS}s"
tail -n 20 "$R/log.txt"
