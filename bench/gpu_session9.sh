#!/usr/bin/env bash
# Session 9's GPU call for issues 30 and 34, one device call after bench/gpu_run.sh's set-up (under 9 minutes):
#     bash bench/gpu_run.sh -- bash bench/gpu_session9.sh
# a. bench.speculative on the llama 1b preset: off, prompt lookup and a draft model (tiny, made with make-model
#    --draft-for: the 1b's tokenizer), 5 interleaved rounds of 256 tokens -> $OUT/gpu/speculative/modes-1b.{json,md}
# b. the agent replay at the 1b preset, Claude Code's session, mode plain, cold first and last, against
#    mlx_lm.server too, one family at a time in this order for the time left (a family that fails, or cannot serve
#    the traffic, is logged and the next one runs): $OUT/gpu/agent_replay/<family>/, the daemon's and worker's
#    logs (worker at debug) in $OUT/gpu/agent_replay/logs/<family>/.
# Every step is bounded by `timeout`; BUDGET_S (default 500 s; with `timeout -k` and gpu_run.sh's set-up, under 9
# minutes) is the whole script's. A dry run of the same steps on a CPU:
#     OUT=/tmp/o WORK=/tmp/w PRESET=tiny PY=.venv/bin/python FAMILIES=qwen3 bash bench/gpu_session9.sh
set -u
R=$OUT/gpu W=${WORK:-/tmp/s9w} PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-500}
PRESET=${PRESET:-1b}
mkdir -p "$R/speculative" "$R/agent_replay"
left() { echo $((BUDGET_S - SECONDS)); }

if [ "${PART:-all}" != replay ]; then
timeout 120 "$PY" -m worker.mlx_engine.make_model "$W/target" --preset "$PRESET" > "$R/speculative/make.log" 2>&1
echo "make-model exit $? at ${SECONDS}s"
timeout -k 10 170 taskset -c 0-3 "$PY" -m bench.speculative --model "$W/target" --modes off,prompt-lookup,draft \
  --draft-preset tiny --rounds 5 --tokens 256 --work "$W" --out "$R/speculative/modes-$PRESET.json" \
  > "$R/speculative/modes.log" 2>&1
echo "speculative exit $? at ${SECONDS}s"; cat "$R/speculative/modes-$PRESET.md" 2>/dev/null
for n in ${ORACLE_STREAMS-1 4 8}; do  # the oracle (every draft kept, free) at k = 1..8, alone and with n streams drafting in lockstep
  timeout -k 10 80 taskset -c 0-3 "$PY" -m bench.speculative --model "$W/target" --oracle 1,2,4,8 --streams $n \
    --rounds 3 --tokens 256 --work "$W" --out "$R/speculative/oracle-streams$n-$PRESET.json" \
    > "$R/speculative/oracle-streams$n.log" 2>&1
  echo "oracle streams=$n exit $? at ${SECONDS}s"; cat "$R/speculative/oracle-streams$n-$PRESET.md" 2>/dev/null
done
fi
[ "${PART:-all}" = spec ] && { tar czf "$OUT/session9.tgz" -C "$OUT" gpu; exit 0; }

for family in ${FAMILIES:-qwen3 qwen3_5 gemma3 llama gpt_oss}; do
  budget=$(( $(left) - 15 ))  # 15 s kept for the archive
  if [ "$budget" -lt 60 ]; then echo "$family: not run (${budget}s left)"; continue; fi
  timeout -k 20 "$budget" "$PY" -m bench.agent_replay --families "$family" --preset "$PRESET" --hot 16GiB \
    --programs claude --modes plain --cold first,last --server mlx_lm --out "$R/agent_replay/$family" \
    --logs "$R/agent_replay/logs" > "$R/agent_replay/$family.log" 2>&1
  echo "$family exit $? at ${SECONDS}s"; tail -3 "$R/agent_replay/$family.log"
  pgrep -fa "supervisor serve|mlx_lm.server|python3? -m worker" | head -5  # should be empty: the replay stops its own
done
tar czf "$OUT/session9.tgz" -C "$OUT" gpu; ls -la "$OUT"
