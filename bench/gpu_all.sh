#!/usr/bin/env bash
# One device call that checks and times everything GPU-side, section by section:
#   bash bench/gpu_all.sh [SECTION ...]      sections: tests train serve profile kda trainprof kdafla kdaprof shortconv situ attnres combine route ce trainer ncu router groupedmm gmm step ncuconv gaps dist rl distill mxfp4 draft spec balance
#                                            (default: tests train serve profile kda)
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
    tests)  # GPU_TESTS narrows the set (e.g. GPU_TESTS=tests/ops: the kernels only; the whole set took 385 s)
      python -m pytest -q --durations=12 -m gpu ${GPU_TESTS:-tests/ops tests/model tests/serve/test_model_runner.py \
        tests/serve/test_compiled_decode.py} 2>&1 | tail -60 > "$OUT/tests.txt"
      grep -E "passed|failed|^FAILED|^E |^[0-9.]+s (call|setup)" "$OUT/tests.txt" | head -30 ;;
    train)
      { python bench/train.py --seq-lens 8192 --steps 3 --backends triton --compile --tokens 65536 --accum 2 \
          --embed-dtype bf16,fp32 --situ triton,torch --attnres triton,torch --combine triton,torch
        python bench/train.py --seq-lens 8192 --steps 3 --backends triton --compile --tokens 65536 --accum 2 \
          --doc-mean 1500
        python bench/train.py --seq-lens 8192 --steps 3 --backends triton --compile --accum 8; } 2>&1 | quiet > "$OUT/train.txt"
      grep -E "^\|" "$OUT/train.txt" ;;
    step)  # the headline: k3-small's recipe step (8 micro-batches of 8 x 8,192 tokens) (STEP_ARGS: more bench/train.py flags, e.g. --ce torch,triton for an A/B;
      # STEP_TOKENS / STEP_ACCUM: an 80 GB H100 needs STEP_TOKENS=32768 STEP_ACCUM=2, the 8 x 64K step takes 84 GB)
      python bench/train.py --seq-lens 8192 --steps 3 --backends triton --compile --tokens ${STEP_TOKENS:-65536} --accum ${STEP_ACCUM:-8} \
        ${STEP_ARGS:-} 2>&1 | quiet > "$OUT/step.txt"
      grep -E "^\||^# T" "$OUT/step.txt" ;;
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
    trainprof)  # where a compiled k3-small training step spends its time
      { python bench/profile_step.py --phases train,optim --compile --rows 45 --tokens 65536 --host --by-shape --by-node
        python bench/profile_step.py --phases train --compile --rows 25 --tokens 65536 --doc-mean 1500; } 2>&1 | quiet \
        > "$OUT/trainprof.txt"
      grep -E "^## " "$OUT/trainprof.txt" ;;
    kdafla)  # k3 vs fla training rows in one process; fla's autotune results are kept (TRITON_CACHE_AUTOTUNING)
      # under $KDA_TUNE_DIR, tarred to $OUT/fla_autotune.tgz: unpack it there in a later call to skip the warm-up
      site=/tmp/fla_site; pip install -q --no-deps --target $site .whl/*.whl >/dev/null 2>&1
      export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${KDA_TUNE_DIR:-/tmp/kda_tune} TRITON_PRINT_AUTOTUNING=1
      PYTHONPATH=$PWD:$site timeout ${KDAFLA_S:-420} python bench/kda.py --quick --sections train 2>&1 | quiet > "$OUT/kdafla.txt"
      (cd $TRITON_CACHE_DIR && find . -name "*.autotune.json" | tar czf "$OUT/fla_autotune.tgz" -T -)
      grep -E "^\||autotuning|finished after" "$OUT/kdafla.txt" | head -40 ;;
    kdaprof)  # issue #31's shapes, k3 vs fla in one process: times, targets, per-kernel profile with roofline fractions
      # (bench/kda_profile.py; KDA_FLA_TUNED: fla's autotuned configs of an earlier run, skips its minutes of warm-up)
      site=/tmp/fla_site; pip install -q --no-deps --target $site .whl/*.whl >/dev/null 2>&1
      PYTHONPATH=$PWD:$site timeout ${KDAFLA_S:-420} python bench/kda_profile.py --profile \
        ${KDA_FLA_TUNED:+--fla-tuned $KDA_FLA_TUNED} 2>&1 | quiet > "$OUT/kdaprof.txt"
      grep -E "^\||^  ->|^    \|" "$OUT/kdaprof.txt" ;;
    shortconv)  # short conv + SiLU kernels vs the transpose + cuDNN depthwise conv path, x in
      # the model's layout (a slice of the 4232-wide fused projection), with the tile sweep; then contiguous x
      { python bench/short_conv.py --sweep --tokens 65536 --row-width 4232
        python bench/short_conv.py --tokens 65536; } 2>&1 | quiet > "$OUT/shortconv.txt"
      grep -E "^\||check" "$OUT/shortconv.txt" ;;
    situ)  # SiTU-GLU: Triton kernels vs the Inductor regions vs eager, k3-small's shapes at 64K tokens
      python bench/situ.py --sweep 2>&1 | quiet > "$OUT/situ.txt"
      grep -E "^\||check" "$OUT/situ.txt" ;;
    trainer)  # the real `k3 train` loop (data loader, Quantile Balancing, clipping, logging) on k3-small's
      # recipe, over k3's own source as a small corpus: tokens/s and MFU per step from metrics.jsonl
      # (k3's source is ~220K tokens: 2 x 64K micro-batches per step and a tenth held out, so every
      # stage of the preset and the 8K validation rows fit)
      rm -rf /tmp/k3run; echo '{"tokens_per_step": 131072, "val_fraction": 0.1}' > /tmp/k3run.json
      timeout ${TRAINER_S:-300} python -m k3 train --preset ${TRAINER_PRESET:-k3-small} --data k3 --max-steps ${TRAINER_STEPS:-8} \
        --config /tmp/k3run.json --out /tmp/k3run 2>&1 | tr '\r' '\n' | quiet | tail -40 > "$OUT/trainer.txt"
      cp /tmp/k3run/metrics.jsonl "$OUT/trainer_metrics.jsonl" 2>/dev/null
      python -c "import json; [print({k: r.get(k) for k in ('step', 'seq_len', 'loss', 'tok_s', 'tflops', 'mfu')}) for r in map(json.loads, open('/tmp/k3run/metrics.jsonl')) if 'loss' in r]" 2>&1 | tail -12 ;;
    combine)  # MoE combine: Triton kernels vs the Inductor region vs eager
      python bench/moe_combine.py --sweep 2>&1 | quiet > "$OUT/combine.txt"
      grep -E "^\||check" "$OUT/combine.txt" ;;
    route)  # MoE routing bookkeeping (top-k, slot sort): Triton kernels vs the model's torch code
      python bench/moe_route.py --sweep 2>&1 | quiet > "$OUT/route.txt"
      grep -E "^\||check" "$OUT/route.txt" ;;
    ce)  # lm_head + cross-entropy: the fused chunked path (k3.ops.cross_entropy) vs the Inductor region vs
      # eager, then the k3-small step with the torch loss and the fused one
      { python bench/cross_entropy.py --chunks 4096,8192,16384 --sweep
        python bench/train.py --seq-lens 8192 --steps 3 --backends triton --compile --tokens 65536 --accum 2 \
          --ce torch,triton; } 2>&1 | quiet > "$OUT/ce.txt"
      grep -E "^\||check" "$OUT/ce.txt" ;;
    ncu)  # Nsight Compute on k3-small's KDA layer (bench/ncu_target.py): one launch of $NCU_KERNEL (default the
      # backward key kernel) with every section, printed as details + per-SASS-line stall samples (CSV), then
      # a speed-of-light / occupancy summary of every KDA kernel of one forward + backward
      N=${NCU_KERNEL:-_kda_bwd_keys}
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      { $NCU --clock-control none -k regex:$N -s 1 -c 1 --set full --import-source yes -f -o "$OUT/ncu_$N" \
          python bench/ncu_target.py kda
        $NCU -i "$OUT/ncu_$N.ncu-rep" --page details; } > "$OUT/ncu.txt" 2>&1
      $NCU -i "$OUT/ncu_$N.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${N}_sass.csv" 2>&1
      $NCU --clock-control none -k regex:_kda -s 12 -c 14 --section SpeedOfLight --section Occupancy \
        --section LaunchStats python bench/ncu_target.py kda > "$OUT/ncu_all.txt" 2>&1
      grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|^  _kda" \
        "$OUT/ncu_all.txt" | head -80
      grep -E -i "stall|warp cycles per|issued ipc|est. speedup" "$OUT/ncu.txt" | head -40 ;;
    ncuconv)  # Nsight Compute on the short conv's kernels of one k3-small layer (forward, backward), x sliced from the fused projection (row width
      # 4232, as the model) and contiguous (0)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for rw in ${NCU_ROW_WIDTHS:-4232 0}; do
        $NCU --clock-control none -k regex:"_conv_|_short_conv" -s ${NCU_COUNT:-2} -c ${NCU_COUNT:-2} --set full \
          -f -o "$OUT/ncu_conv_$rw" \
          python bench/ncu_target.py conv --row-width $rw > /dev/null 2>&1
        $NCU -i "$OUT/ncu_conv_$rw.ncu-rep" --page details > "$OUT/ncuconv_$rw.txt" 2>&1
        echo "-- row width $rw"
        grep -E "^  _short|^  _conv|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Mem Busy|Max Bandwidth|Issue Slots Busy" \
          "$OUT/ncuconv_$rw.txt" | head -60
      done ;;
    gaps)  # where the GPU idles in a compiled k3-small micro-batch (bench/gaps.py): gaps between kernels charged
      # to the host code launching after them, plus host calls that block
      python bench/profile_step.py --phases train --compile --tokens 65536 --gaps --rows ${GAP_ROWS:-40} 2>&1 | quiet \
        > "$OUT/gaps.txt"
      grep -E "without the profiler" "$OUT/gaps.txt"; sed -n "/^## device gaps/,\$p" "$OUT/gaps.txt" | head -60 ;;
    gmm)  # k3's Triton grouped GEMMs (k3.ops.grouped_gemm) vs torch._grouped_mm (+ the fp32 gradient add), tile sweep
      python bench/grouped_gemm.py ${GMM_ARGS:-} 2>&1 | quiet > "$OUT/gmm.txt"
      grep -E "^\||^#" "$OUT/gmm.txt" ;;
    groupedmm)  # the routed experts' five grouped GEMMs in alternative operand layouts (k3-small, 64K tokens)
      python bench/grouped_mm.py 2>&1 | quiet > "$OUT/groupedmm.txt"
      grep -E "^\||^#" "$OUT/groupedmm.txt" ;;
    router)  # MoE router scores: split bf16 GEMMs (k3.ops.router) vs the fp32 region vs eager
      python bench/router.py 2>&1 | quiet > "$OUT/router.txt"
      grep -E "^\||check" "$OUT/router.txt" ;;
    attnres)  # Block-AttnRes mix: Triton kernels vs the Inductor regions vs eager
      python bench/attn_res.py --sweep 2>&1 | quiet > "$OUT/attnres.txt"
      grep -E "^\||check" "$OUT/attnres.txt" ;;
    dist)  # 2 GPUs over NCCL (needs a 2-GPU kind): the distributed equalities with CUDA tensors, then k3 train
      # under torchrun (FSDP2, --ep 2, --cp 2) vs one GPU: losses, tokens/s per GPU, scaling, peak memory
      # (DIST_ARGS: more bench/dist.py flags, e.g. "--long-seq 131072")
      K3_TEST_DEVICE=cuda python -m pytest -q tests/distributed 2>&1 | tail -30 > "$OUT/dist_tests.txt"
      grep -E "passed|failed|^FAILED|^E " "$OUT/dist_tests.txt" | head -20
      python bench/dist.py --preset ${DIST_PRESET:-k3-small} --steps ${DIST_STEPS:-6} --compile ${DIST_ARGS:-} \
        2>&1 | quiet > "$OUT/dist.txt"
      grep -E "^\||^#" "$OUT/dist.txt" ;;
    rl)  # k3 rl on one GPU (bench/rl.py, k3-small, bf16 serving copy): rollout / trainer tokens/s, decode idle
      # fraction and wall time per step, synchronous vs partial rollouts on long-tailed attempt lengths (RL_ARGS: more flags)
      python bench/rl.py --preset ${RL_PRESET:-k3-small} --device cuda --out "$OUT/rl.jsonl" ${RL_ARGS:-} 2>&1 | quiet \
        > "$OUT/rl.txt"
      grep -E "^\{|Error|error" "$OUT/rl.txt" | tail -8 ;;
    distill)  # teacher log-prob scoring for on-policy distillation (bench/distill.py, k3-small, bf16): tokens/s and
      # peak memory per packed batch shape, next to full-logits size and the student's OPD forward + backward
      python bench/distill.py --preset ${DISTILL_PRESET:-k3-small} --device cuda --out "$OUT/distill.jsonl" \
        ${DISTILL_ARGS:-} 2>&1 | quiet > "$OUT/distill.txt"
      grep -E "^\||Error|error" "$OUT/distill.txt" | tail -8 ;;
    mxfp4)  # MXFP4 grouped GEMM (k3.ops.mxfp4_gemm): kernel + QAT GPU tests, then the bench vs bf16 torch._grouped_mm
      # with the tile sweep (k3-small, kimi-k3; decode 1-64, prefill 8192) and the k3-small forward (MXFP4_ARGS: more flags)
      python -m pytest -q -m gpu tests/ops/test_mxfp4_gemm.py tests/quant 2>&1 | tail -20 > "$OUT/mxfp4_tests.txt"
      grep -E "passed|failed|^FAILED|^E " "$OUT/mxfp4_tests.txt" | head -20
      python bench/mxfp4_gemm.py --batches 1,4,16,64 --reps 10 --sweep ${MXFP4_ARGS:-} 2>&1 | quiet > "$OUT/mxfp4.txt"
      grep -E "^\||^# best|^device" "$OUT/mxfp4.txt" ;;
    draft)  # learned-draft (EAGLE-3) speculative decoding on k3-small: decode tokens/s plain vs draft vs n-gram and
      # tau at batch 1, 8, 32 (a draft trained here for DRAFT_STEPS on the target's continuations; DRAFT_ARGS:
      # more bench/draft.py flags, e.g. "--checkpoint CK --draft CK_DRAFT" for a trained target)
      timeout ${DRAFT_S:-540} python bench/draft.py --markdown --train-steps ${DRAFT_STEPS:-300} ${DRAFT_ARGS:-} 2>&1 \
        | quiet > "$OUT/draft.txt"
      grep -E "^\||^# |ERROR|Error" "$OUT/draft.txt" ;;
    spec)  # issue 30's k3-small acceptance run: a target trained here (SPEC_ARGS, e.g. "--target-seconds 60"), a draft
      # distilled from its greedy outputs, plain / n-gram / draft (speculation policy on) / draft-all at batch 1, 8, 32
      timeout ${SPEC_S:-540} python bench/spec.py --markdown ${SPEC_ARGS:-} 2>&1 | quiet > "$OUT/spec.txt"
      grep -E "^\||^# |ERROR|Error" "$OUT/spec.txt" ;;
    balance)  # Quantile Balancing vs the sign update on k3-small (issue 33's GPU check): BALANCE_STEPS steps of
      # 8 rows x 8,192 tokens (one stage, so every step of the tail has 8 independent rows) over torch's Python source
      # (BALANCE_DATA; the device's slim stdlib is 2.4M tokens, 8 epochs of a 300-step run)
      data=${BALANCE_DATA:-$(python -c "import os, torch; print(os.path.dirname(torch.__file__))")}
      timeout ${BALANCE_S:-540} python bench/balance.py --preset k3-small --methods ${BALANCE_METHODS:-quantile,sign} \
        --set data=\"$data\" \
        --max-steps ${BALANCE_STEPS:-300} --set tokens_per_step=65536 --set micro_batch_tokens=32768 \
        --set 'stages=[{"seq_len": 8192, "fraction": 1.0}]' --set warmup_steps=30 --set eval_every=100 \
        --set eval_tokens=262144 --out /tmp/balance 2>&1 | tr '\r' '\n' | quiet | tail -60 > "$OUT/balance.txt"
      for f in /tmp/balance/balance.* /tmp/balance/*/metrics.jsonl; do  # not the checkpoints
        mkdir -p "$OUT/$(dirname ${f#/tmp/})"; cp "$f" "$OUT/${f#/tmp/}"; done
      grep -E "^\||Error|error" "$OUT/balance.txt" ;;
    *) echo "unknown section: $s (tests, train, serve, profile, kda, trainprof, kdafla, kdaprof, shortconv, situ, attnres, combine, route, ce, trainer, ncu, router, groupedmm, gmm, step, ncuconv, gaps, dist, rl, distill, mxfp4, draft, spec, balance)"; exit 2 ;;
  esac
  echo "== $s: $(( $(date +%s) - start )) s"
done
