#!/usr/bin/env bash
# The laptop chain of docs/distill.md: specialist teachers by `k3 rl`, merged by `k3 distill`.
#   bash bench/distill_chain.sh SFT_FINAL OUT [DISTILL_STEPS]
# SFT_FINAL: `k3 sft`'s final/ (the teachers' RL start and the student). Writes OUT/t_math (the
# math teacher: `k3 rl`'s default run, all three efforts, which is also issue 27's acceptance run),
# OUT/t_worlds (the tool-use teacher, trained at efforts low and max), OUT/distill (the student:
# both teachers at low and max), OUT/effort_eval.txt (thinking length per effort with non-binding caps) and
# OUT/times.txt (wall seconds and load of each stage). A stage whose final/ exists is skipped (rerun = resume). Extra environment: K3 (default
# "python -m k3"), NICE (default 0).
set -euo pipefail
sft=${1:?usage: bench/distill_chain.sh SFT_FINAL OUT [DISTILL_STEPS]}
out=${2:?usage: bench/distill_chain.sh SFT_FINAL OUT [DISTILL_STEPS]}
steps=${3:-40}
k3=${K3:-python -m k3}
run() {  # run NAME CMD...: time one stage, record wall seconds and the load average (skipped when OUT/NAME/final exists)
  local name=$1 t0; shift
  if [ -d "$out/$name/final" ]; then echo "== $name: $out/$name/final exists, skipped"; return; fi
  t0=$(date +%s)
  echo "== $name: $*"
  nice -n "${NICE:-0}" "$@"
  echo "$name $(( $(date +%s) - t0 )) s; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/times.txt"
}
mkdir -p "$out"
run t_math   $k3 rl --base "$sft" --out "$out/t_math"
run t_worlds $k3 rl --base "$sft" --tasks worlds --efforts low,max --out "$out/t_worlds"
run distill  $k3 distill --student "$sft" \
    --teacher math:low="$out/t_math/final"     --teacher math:max="$out/t_math/final" \
    --teacher worlds:low="$out/t_worlds/final" --teacher worlds:max="$out/t_worlds/final" \
    --out "$out/distill" --max-steps "$steps" --eval-tasks 48 --eval-group 4
run effort_eval_math python -m k3.rl.effort_eval "$sft" "$out/t_math/final" "$out/distill/final" \
    --kind math --tasks 32 --group 4 | tee -a "$out/effort_eval.txt"
run effort_eval_worlds python -m k3.rl.effort_eval "$sft" "$out/t_worlds/final" "$out/distill/final" \
    --kind worlds --efforts low,max --tasks 32 --group 4 | tee -a "$out/effort_eval.txt"
