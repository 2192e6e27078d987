#!/usr/bin/env bash
# Where a single stream's extra millisecond per token goes in the worker process (issue 15), after
# bench/gpu_run.sh's set-up:   bash bench/gpu_run.sh -- bash bench/gpu_diag2.sh
# bench.diagnose worker,engine under `py-spy record --subprocesses --idle` (every worker subprocess sampled too),
# so the same Engine code's stacks can be set side by side: in the diagnose process (engine part, variant D) and in
# a real worker (worker part); then, if DIAG_THROUGHPUT is set, the warm-up-off throughput run (the CUDA crash).
# Everything lands in $OUT/diag2.tgz.
set -u
W=/tmp/bw R=/tmp/diag2
mkdir -p "$R"
python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" || exit 6
timeout 300 py-spy record --subprocesses --idle --rate 250 --format raw -o "$R/spy.txt" -- \
  python3 -m bench.diagnose --model "$W/models/bench-1b" --out "$R/diag.json" --parts worker,engine --rounds 3 > "$R/diag.log" 2>&1
echo "diagnose exit $?"; grep "^\[diagnose\]" "$R/diag.log" | cut -c1-1500
if [ -n "${DIAG_THROUGHPUT:-}" ]; then
  printf '[server]\nwarm_batch_shapes = "off"\n' > /tmp/warmoff.toml
  MLXSUP_CONFIG=/tmp/warmoff.toml timeout 200 python3 -m bench --profile gpu --out "$R/warmoff" --work "$W" --deadline 140 \
    --sections throughput --concurrency "$DIAG_THROUGHPUT" --rounds 1 > "$R/warmoff.log" 2>&1
  echo "warmoff exit $?"; grep -h -m5 -i "cudaMemcpy\|Traceback\|crash" "$W"/state-throughput/logs/*.log
  cp -r "$W"/state-throughput/logs "$R/logs-warmoff" 2>/dev/null
fi
xz -T4 "$R/spy.txt"; tar czf "$OUT/diag2.tgz" -C /tmp diag2; ls -la "$OUT"
