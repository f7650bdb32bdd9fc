#!/usr/bin/env bash
# One device call that checks and times everything GPU-side, section by section:
#   bash bench/gpu_all.sh [SECTION ...]      sections: tests train serve profile kda   (default: all)
# Each section writes its log to ${OUT:-bench_out}/<section>.txt and prints a short summary, so a
# run cut short by the call's time limit still returns what finished. Needs PYTHONPATH=repo root
# (set here); the device machine has torch + triton but not fastapi/openai, so the HTTP-server tests
# are not part of the GPU test set.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
sections=${*:-tests train serve profile kda}
quiet() { grep -v -i -E "warn|online softmax|split the reduction|important use case|softmax\.$|^\s*$" ; }

for s in $sections; do
  start=$(date +%s)
  case $s in
    tests)
      python -m pytest -q -m gpu tests/ops tests/model tests/serve/test_model_runner.py \
        tests/serve/test_compiled_decode.py 2>&1 | tail -60 > "$OUT/tests.txt"
      grep -E "passed|failed|^FAILED|^E " "$OUT/tests.txt" | head -20 ;;
    train)
      { python bench/train.py --seq-lens 4096,8192 --steps 4 --backends triton
        python bench/train.py --seq-lens 8192 --steps 4 --backends triton --compile; } 2>&1 | quiet > "$OUT/train.txt"
      grep -E "^\|" "$OUT/train.txt" ;;
    serve)
      { python bench/serve.py --which decode,agentic --compile --markdown
        python bench/mla_decode.py; } 2>&1 | quiet > "$OUT/serve.txt"
      grep -E "^\||throughput" "$OUT/serve.txt" ;;
    profile)
      python bench/profile_step.py --phases prefill,decode --decode-batch 8 --compile --rows 30 2>&1 | quiet \
        > "$OUT/profile.txt"
      grep -E "^## |^engine:" "$OUT/profile.txt" ;;
    kda)
      python bench/kda.py --quick --sections train,decode 2>&1 | quiet > "$OUT/kda.txt"
      grep -E "^\|" "$OUT/kda.txt" ;;
    *) echo "unknown section: $s (tests, train, serve, profile, kda)"; exit 2 ;;
  esac
  echo "== $s: $(( $(date +%s) - start )) s"
done
