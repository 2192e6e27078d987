#!/usr/bin/env bash
# Issue 30, session 13: one device call each, after bench/gpu_run.sh's set-up, on the 1b preset (EOS unreachable);
# results in $OUT/s13-MODE:
#     bash bench/gpu_run.sh -- bash bench/gpu_s13.sh MODE
#   targets: the profile's throughput section at 1, 8 and 32 clients, ROUNDS (7) interleaved rounds, servers on
#            CPUs 0-3 (the profile's pinning; SERVER_CPUS=0-7: on 8; CONC, ROUNDS: other clients, rounds): issue 30's
#            three targets in one run
#   extra:   the single stream with the servers on CPUs 0-7 (3 rounds: is the daemon's extra ITL its processes'
#            share of 4 CPUs?), then batch drafting on CUDA: the oracle at k=4 with 8 streams, identical (every
#            draft kept) and each stream's record wrong at every 7th token at its own offset (rows keeping their
#            own counts), 3 rounds each
#   split:   the single stream's time split, servers' CPUs 0-3, 10 rounds: bench.diagnose engine (stream_generate, the
#            Engine by submit/step, the same plus msgpack + ZeroMQ send and poll) and worker (stream_generate in a
#            subprocess, a worker subprocess over bare ZeroMQ): where the worker's extra time a token goes
#   nossd:   32 clients, ROUNDS (12) rounds: mlxsup as configured by default against the same tree with the SSD
#            cache off (mlxsup_b, MLXSUP_CONFIG with [cache] ssd = false): is the later rounds' slowdown the writer?
set -u
MODE=${1:?targets, extra, split or nossd}
source "$(dirname "$0")/gpu_1b.sh"
case $MODE in
  targets)
    rm -rf "$W/state-throughput"
    timeout 560 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline "${TP_DEADLINE:-500}" \
      --sections throughput --concurrency "${CONC:-1,8,32}" --rounds "${ROUNDS:-7}" --server-cpus "${SERVER_CPUS:-auto}" \
      > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md" ;;
  extra)
    rm -rf "$W/state-throughput"
    timeout 200 python3 -m bench --profile gpu --out "$R/cpus8" --work "$W" --deadline 150 --sections throughput \
      --concurrency 1 --rounds 3 --server-cpus 0-7 > "$R/log-cpus8.txt" 2>&1
    echo "cpus 0-7: bench exit $? at ${SECONDS}s"; tables "$R/cpus8/results.md"
    for wrong in 0 7; do
      timeout 150 python3 -m bench.speculative --model "$S" --oracle 4 --streams 8 --wrong $wrong --rounds 3 \
        --tokens 256 --out "$R/oracle-streams8-wrong$wrong.json" > "$R/oracle-wrong$wrong.log" 2>&1
      echo "oracle 8 streams wrong=$wrong: exit $? at ${SECONDS}s"
      python3 -c "import json; d=json.load(open('$R/oracle-streams8-wrong$wrong.json')); print({k: (round(v['speedup_vs_off_p50'], 3), v['acceptance']) for k, v in d['curve'].items()}, 'parity', d['parity'])"
    done ;;
  split)
    DIAG_ENGINE_VARIANTS=S_mlx_lm_stream_generate,B_engine_submit_step,D_engine_plus_zmq_msgpack timeout 520 \
      taskset -c 0-3 python3 -m bench.diagnose --model "$M" --out "$R/split.json" --parts engine,worker \
      --worker-variants W_plain --rounds "${ROUNDS:-10}" > "$R/split.log" 2>&1
    echo "split exit $? at ${SECONDS}s"
    python3 -c "
import json; d = json.load(open('$R/split.json'))
for part in ('engine', 'worker'):
    x = d.get(part, {})
    print(part, json.dumps(x.get('itl_p50_ms_median') or {k: v.get('itl_p50_ms_median') if isinstance(v, dict) else v for k, v in x.items() if k != 'tokens'}))
    print(part, 'per round', json.dumps(x.get('itl_p50_ms_per_round') or {k: v.get('itl_p50_ms_per_round') for k, v in x.items() if isinstance(v, dict)}))
    print(part, 'perf', json.dumps(x.get('solo_per_token_ms') or {k: v.get('solo_per_token_ms') for k, v in x.items() if isinstance(v, dict)})[:1500])
" ;;
  nossd)
    printf '[cache]\nssd = false\n' > /tmp/nossd.toml
    rm -rf "$W/state-throughput" "$W/state-throughput-b"
    timeout 560 python3 -m bench --profile gpu --out "$R/gpu" --work "$W" --deadline 480 --sections throughput \
      --concurrency 32 --rounds "${ROUNDS:-12}" --mlxsup-b "$PWD" --mlxsup-b-env MLXSUP_CONFIG=/tmp/nossd.toml \
      > "$R/log.txt" 2>&1
    echo "bench exit $? at ${SECONDS}s"; tables "$R/gpu/results.md"
    sed -n '/^| clients | tok\/s mlxsup \/ mlxsup_b/,/^$/p' "$R/gpu/results.md"
    python3 -c "
import json; d = json.load(open('$R/gpu/results.json'))
for side in ('inproc', 'mlxsup', 'mlxsup_b'):
    print(side, [(r['round'], round(r['itl_p50_s'] * 1e3, 2), round(r['tok_s'])) for r in d['throughput']['runs'] if r['side'] == side])
" ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
