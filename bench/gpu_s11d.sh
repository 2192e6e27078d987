#!/usr/bin/env bash
# Issue 30, session 11, fourth call: is the worker's model slower to decode (how it was loaded, its attention
# route), and the Engine's solo against stream_generate in one process, 12 rounds each, on CPUs 0-3.
#     bash bench/gpu_run.sh -- bash bench/gpu_s11d.sh
set -u
W=/tmp/bw R=$OUT/s11d
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
timeout 150 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/loads.json" --parts loads \
  --rounds 12 > "$R/loads.log" 2>&1
echo "loads exit $? at ${SECONDS}s"
python3 -c "import json; d=json.load(open('$R/loads.json'))['loads']; print(json.dumps(d['itl_p50_ms_median'])); print(json.dumps(d['ratio_to_load_first_median'])); print(json.dumps(d['itl_p50_ms_per_round']))"
DIAG_ENGINE_VARIANTS=S_mlx_lm_stream_generate,S_stream_generate_engine_model,B_engine_submit_step \
  timeout 150 taskset -c 0-3 python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/engine.json" --parts engine \
  --rounds 12 > "$R/engine.log" 2>&1
echo "engine exit $? at ${SECONDS}s"
python3 -c "import json; d=json.load(open('$R/engine.json'))['engine']; print(json.dumps(d['itl_p50_ms_median'])); print(json.dumps(d['itl_p50_ms_per_round']))"
