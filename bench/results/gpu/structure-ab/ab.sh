#!/usr/bin/env bash
# Interleaved A/B of the throughput section: bash ab.sh LABEL... (e.g. 1-before 1-after); each LABEL is N-SIDE.
# Runs from git-archive snapshots unpacked at /tmp/t-SIDE; results to $OUT/LABEL/{gpu,gpu-log.txt}.
# Stops starting runs when fewer than 175 s of the call's 580 s remain.
set -u
R=$PWD; T0=$(date +%s)
declare -A C=([before]=c2f2d31fc97a3a601f68b8c262733f49843e9ff0 [after]=362074ec172c965c14a6d1523cfc57129b53ec0e)
for s in before after; do
  [ -f /tmp/t-$s/pyproject.toml ] || { mkdir -p /tmp/t-$s && tar xJf "$R/.mlx-cuda/trees/$s.tar.xz" -C /tmp/t-$s; }
done
for label in "$@"; do
  side=${label#*-}
  el=$(( $(date +%s) - T0 ))
  if [ "$label" != "$1" ] && [ $el -gt 405 ]; then echo "SKIP $label at ${el}s"; continue; fi
  echo "=== $label ($side ${C[$side]}) start $(date -u +%H:%M:%S) elapsed ${el}s"
  rm -rf /tmp/bw/state-throughput /tmp/bw/models /tmp/bw/logs
  ( cd /tmp/t-$side && MLXSUP_BENCH_TREE="$side: git archive ${C[$side]}" CARRY=$R OUT=$OUT/$label DEADLINE=${DEADLINE:-200} \
      bash bench/gpu_run.sh --sections throughput --concurrency 1,8,32 --rounds 3 > $OUT/$label.stdout 2>&1 ); echo "rc $?"
  python3 -c "
import json,sys
t=json.load(open(sys.argv[1]))['throughput']['summary']
for c,v in t.items():
    r=v.get('ratios',{}) if isinstance(v,dict) else {}
    print(c,{k:(round(r[k]['median_of_round_ratios'],3),r[k]['per_round']) for k in ('mlxsup/inproc','mlxsup/mlx_lm.server') if k in r})
" $OUT/$label/gpu/results.json || tail -20 $OUT/$label.stdout
  echo "=== $label end $(date -u +%H:%M:%S)"
done
