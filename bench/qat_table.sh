#!/usr/bin/env bash
# The bf16 / PTQ-MXFP4 / QAT-MXFP4 table of docs/quantization.md, two ways:
#
#   bash bench/qat_table.sh OUT_DIR [k3 train flags, e.g. --device cuda --config FILE]
#       two training runs of the same config and seed (bf16, then --qat mxfp4), PTQ of the bf16 run's final
#       checkpoint, and every checkpoint's validation loss on its run's held-out split.
#   bash bench/qat_table.sh --continue RUN OUT_DIR STEPS
#       QAT as a later stage of a finished `k3 train` RUN (as K3 does it, from SFT on): PTQ of RUN's final
#       checkpoint, then STEPS more steps of RUN's schedule without (the bf16 control) and with --qat mxfp4
#       (bench/qat_finetune.py), PTQ of the control, and the validation losses.
#
# MXFP4 experts are evaluated packed (computing with exactly the stored weights); `k3 quantize --eval-run`
# also prints the trainer's last (fake-quant) evaluation of the QAT model.
set -euo pipefail
k3() { python -m k3 "$@"; }
if [ "${1:-}" = "--continue" ]; then
  run=${2:?usage: bench/qat_table.sh --continue RUN OUT_DIR STEPS}; out=${3:?}; steps=${4:?}
  k3 quantize --checkpoint "$run/final" --out "$out/base-ptq" --format mxfp4 --eval-run "$run"
  python bench/qat_finetune.py --run "$run" --out "$out/cont" --steps "$steps"
  python bench/qat_finetune.py --run "$run" --out "$out/qat" --steps "$steps" --qat mxfp4
  k3 quantize --checkpoint "$out/cont/final" --out "$out/cont-ptq" --format mxfp4 --eval-run "$out/cont"
  k3 quantize --checkpoint "$out/qat/final" --eval-run "$out/qat"
  exit 0
fi
out=${1:?usage: bench/qat_table.sh OUT_DIR [k3 train flags]}
shift
k3 train --out "$out/bf16" "$@"
k3 train --out "$out/qat" --qat mxfp4 "$@"
k3 quantize --checkpoint "$out/bf16/final" --out "$out/ptq" --format mxfp4 --eval-run "$out/bf16"
k3 quantize --checkpoint "$out/qat/final" --eval-run "$out/qat"
