#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: the ragged-prefill targets (BENCHMARKS.md, Prefill
# attention), one part a call (each fits a 10-minute run):
#   OUT=/tmp/out bash scripts/gpu_prefill.sh kernels  # kernel rows: one 8k prompt, 64 prompts of 128-2048 tokens;
#       mosaic (snake item order, half-width diagonal block) beside mosaic_round_robin, mosaic_wide_diagonal
#       (each lever off) and mosaic_before (both off)
#   OUT=/tmp/out bash scripts/gpu_prefill.sh ttft     # engine time to first token, 16k prompt, Qwen3-8B shapes
#   OUT=/tmp/out bash scripts/gpu_prefill.sh profile  # Mosaic GPU profiler trace of the kernel on a 2k prompt
#   OUT=/tmp/out bash scripts/gpu_prefill.sh diagnose # why 64 ragged prompts run at 70 % of one 8k prompt: the same
#       tokens as uniform prompts (64 x 1088: short contexts alone) against ragged ones (imbalance) and fewer longer
#       prompts, each with the levers on (mosaic) and off (mosaic_before)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${1:-kernels}" in
  kernels)
    timeout 560 python3 -m pallas_kernels.bench --sections prefill --prefill-variants round_robin,wide_diagonal,before \
      --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" | grep -v '^{' ;;
  ttft)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 570 python3 -m zipage_jax.bench ttft --model-shape qwen3-8b \
      --prompt-len 16384 --backends mosaic mosaic_decode --prefill-tokens 2048 16384 --trials 3 \
      --json "$OUT/ttft.json" 2>&1 | tee "$OUT/ttft.log" | grep -v '^ ' ;;
  profile)
    timeout 400 python3 -m pallas_kernels.bench --sections prefill --prefill-cases 1x2048 --reps 8 \
      --prefill-profile "$OUT/trace" --json "$OUT/profile_rows.json" 2>&1 | tee "$OUT/profile.log" | tail -12
    gzip -f "$OUT"/trace/*/*.json ;;
  diagnose)
    timeout 580 python3 -m pallas_kernels.bench --sections prefill --time-budget 520 \
      --prefill-cases 1x8192,64x1088,64x128-2048,16x4352,256x272 --prefill-variants before \
      --json "$OUT/diagnose.json" 2>&1 | tee "$OUT/diagnose.log" | grep -v '^{' ;;
  *) echo "usage: OUT=DIR bash scripts/gpu_prefill.sh kernels|ttft|profile|diagnose" >&2; exit 2 ;;
esac
