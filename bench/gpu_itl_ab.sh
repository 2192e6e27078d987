#!/usr/bin/env bash
# Issue 30, session 10's second GPU call, after bench/gpu_run.sh's set-up:
#     bash bench/gpu_run.sh -- bash bench/gpu_itl_ab.sh
# The throughput section at 1, 8 and 32 clients, 5 rounds (the gpu profile: servers on CPUs 0-3, the harness off
# them), with a fifth side mlxsup_b: this tree with the prompt caches off (a config file with [cache] enabled =
# false), in the same rounds: do the default caches (hot + SSD) cost the single stream its ITL?
set -u
R=/tmp/itlab W=/tmp/bw
mkdir -p "$R"
printf '[cache]\nenabled = false\n' > "$R/nocache.toml"
[ -d "$W/models/bench-1b" ] || python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$W/source/1b'), '1b', 0), Path('$W/models/bench-1b'))" > /dev/null || exit 6
rm -rf "$W/state-throughput" "$W/state-throughput-b"
timeout 420 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-380}" \
  --sections throughput --concurrency 1,8,32 --rounds "${ROUNDS:-5}" --mlxsup-b . \
  --mlxsup-b-env "MLXSUP_CONFIG=$R/nocache.toml" > "$R/gpu-log.txt" 2>&1
echo "bench exit $? at ${SECONDS}s"
sed -n '/^| clients | side/,/^$/p;/^| clients | mlxsup \/ in-process/,/^$/p;/^| clients | ITL/,/^$/p;/^A\/B/,/^$/p;/^| clients | tok\/s mlxsup/,/^$/p' "$R/gpu/results.md"
grep -h "hit tokens" "$W"/state-throughput/logs/*.log 2>/dev/null | head -3
cp -r "$W/state-throughput/logs" "$R/logs-a" 2>/dev/null; cp -r "$W/state-throughput-b/logs" "$R/logs-b" 2>/dev/null
tar czf "$OUT/itlab.tgz" -C /tmp itlab; ls -la "$OUT"
