#!/usr/bin/env bash
# Issue 30's single stream, session 11: one device call each, after bench/gpu_run.sh's set-up, on the 1b preset (EOS
# unreachable), everything interleaved in rounds and pinned to CPUs 0-3; results in $OUT/s11-MODE:
#     bash bench/gpu_run.sh -- bash bench/gpu_s11.sh MODE
#   (split, bench.itl_split, was removed in session 15: bench.diagnose's isolate part replaces it)
#   engine: bench.diagnose engine (stream_generate on either model and attention; the Engine's solo) and affinity
#   env:    bench.mlx_env (stream_generate under MLX CUDA's graph settings)
#   loads:  bench.diagnose loads (the weights as mlx_lm.load and the worker load them), then engine again
#   solo:   bench.solo_vs_sg (generate_step, the Solo alone, the Engine; COMPILED=1: its compiled decode too; PIN=1:
#           the Solo built ahead with its threads pinned)
set -u
MODE=${1:?engine, env, loads or solo}
P=${PRESET:-1b} W=/tmp/bw R=$OUT/s11-$MODE
M=$W/models/bench-$P
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/$P'), '$P', 0), Path('$M'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
diag() {  # bench.diagnose PART ROUNDS, its JSON's keys printed
  timeout 240 taskset -c 0-3 python3 -m bench.diagnose --model "$M" --out "$R/$1.json" --parts "$1" --rounds "$2" \
    > "$R/$1.log" 2>&1
  echo "$1 exit $? at ${SECONDS}s"
  python3 -c "import json; print(json.dumps(json.load(open('$R/$1.json'))['$1'])[:4000])"
}
ENGINE=S_mlx_lm_stream_generate,S_stream_generate_engine_model,S_stream_generate_fast_attention,B_engine_submit_step,B_engine_fast_attention
case $MODE in
  engine) DIAG_ENGINE_VARIANTS=$ENGINE diag engine 8
          DIAG_AFFINITY_SETS=c0:0,c1:1,c2:2,c3:3,q:0-3,c8:8 diag affinity 3 ;;
  env) timeout 300 python3 -m bench.mlx_env --model "$M" --out "$R" --rounds "${ROUNDS:-10}" --cpus 0-3 \
         --variants "default;ops10:MLX_MAX_OPS_PER_BUFFER=10;ops60:MLX_MAX_OPS_PER_BUFFER=60;ops250:MLX_MAX_OPS_PER_BUFFER=250;nographs:MLX_USE_CUDA_GRAPHS=0;nographs_ops250:MLX_USE_CUDA_GRAPHS=0,MLX_MAX_OPS_PER_BUFFER=250" \
         > "$R/log.txt" 2>&1
       echo "mlx_env exit $? at ${SECONDS}s"; tail -n 8 "$R/log.txt" ;;
  loads) diag loads 12
         DIAG_ENGINE_VARIANTS=S_mlx_lm_stream_generate,S_stream_generate_engine_model,B_engine_submit_step diag engine 12 ;;
  solo) timeout 240 taskset -c 0-3 python3 -m bench.solo_vs_sg --model "$M" --rounds "${ROUNDS:-14}" ${COMPILED:+--compiled} ${PIN:+--pin} \
          > "$R/log.txt" 2>&1
        echo "solo_vs_sg exit $? at ${SECONDS}s"; grep '^{' "$R/log.txt" ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
