#!/usr/bin/env bash
# The bf16 / PTQ-MXFP4 / QAT-MXFP4 table of docs/quantization.md: two training runs of the same config and
# seed (bf16, then --qat), PTQ of the bf16 run's final checkpoint, and every checkpoint's validation loss on
# its run's held-out split (MXFP4 experts evaluated packed).
#
# Usage: bash bench/qat_table.sh OUT_DIR [extra k3 train flags, e.g. --device cuda --config FILE]
set -euo pipefail
out=${1:?usage: bench/qat_table.sh OUT_DIR [k3 train flags]}
shift
k3() { python -m k3 "$@"; }
k3 train --out "$out/bf16" "$@"
k3 train --out "$out/qat" --qat mxfp4 "$@"
k3 quantize --checkpoint "$out/bf16/final" --out "$out/ptq" --format mxfp4 --eval-run "$out/bf16"
k3 quantize --checkpoint "$out/qat/final" --eval-run "$out/qat"
