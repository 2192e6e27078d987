#!/usr/bin/env bash
# Issue 30, session 11, second call: is the worker's slower decode step its engine or its process?
#     bash bench/gpu_run.sh -- bash bench/gpu_s11b.sh
# 1. bench.diagnose engine on CPUs 0-3: stream_generate, on mlx_lm.load's model and on the Engine's, with mx.fast's
#    attention and with the worker's route; the Engine's solo, with either attention; all in one process, 8 rounds;
# 2. bench.diagnose affinity: stream_generate in a subprocess pinned to each of CPUs 0-3 alone, and to 0-3.
set -u
W=/tmp/bw R=$OUT/s11b
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
DIAG_ENGINE_VARIANTS=S_mlx_lm_stream_generate,S_stream_generate_engine_model,S_stream_generate_fast_attention,B_engine_submit_step,B_engine_fast_attention \
  timeout 240 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/engine.json" --parts engine \
  --rounds 8 > "$R/engine.log" 2>&1
echo "engine exit $? at ${SECONDS}s"
python3 -c "import json; d=json.load(open('$R/engine.json'))['engine']; print(json.dumps(d['itl_p50_ms_median'])); print(json.dumps(d['itl_p50_ms_per_round'])); print(json.dumps(d['solo_per_token_ms'][:4]))"
DIAG_AFFINITY_SETS=c0:0,c1:1,c2:2,c3:3,q:0-3,c8:8 timeout 200 python3 -m bench.diagnose --model "$W/models/bench-1b" \
  --out "$R/affinity.json" --parts affinity --rounds 3 > "$R/affinity.log" 2>&1
echo "affinity exit $? at ${SECONDS}s"
python3 -c "import json; d=json.load(open('$R/affinity.json'))['affinity']; print(json.dumps({k: v.get('itl_p50_ms_per_round') if isinstance(v, dict) else v for k, v in d.items()}))"
