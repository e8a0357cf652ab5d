#!/usr/bin/env bash
# On one GPU, from the repo root: the attention kernels (BENCHMARKS.md, Attention kernels), one stage per call (each
# fits a 10-minute call); rows (JSON) and logs land in $OUT.
#   OUT=/tmp/out bash scripts/gpu_kernels.sh prefill   # one 8k prompt and 64 prompts of 128-2048 tokens: mosaic (snake
#       item order, half-width diagonal block) beside mosaic_round_robin, mosaic_wide_diagonal (each lever off),
#       mosaic_before (both off), cuDNN on dense copies and the XLA reference
#   OUT=/tmp/out bash scripts/gpu_kernels.sh ttft      # the engine's time to first token of a 16k prompt, Qwen3-8B
#       shapes: the prefill kernel (mosaic) against XLA's prefill attention (mosaic_decode)
#   OUT=/tmp/out bash scripts/gpu_kernels.sh profile   # Mosaic GPU profiler trace of the prefill kernel, 2k prompt
#   OUT=/tmp/out bash scripts/gpu_kernels.sh diagnose  # the same tokens as one prompt, uniform prompts of several
#       lengths and ragged ones: what short causal contexts cost, with the levers on and off
#   OUT=/tmp/out bash scripts/gpu_kernels.sh decode    # paged decode rows (B=64/256, ctx 4096) and prefill 8k, with the
#       Triton kernels of the Ampere path when jax-triton is carried as a wheel in .whl/
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${1:-prefill}" in
  prefill)
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
  decode)
    if ls .whl/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:.
    fi
    timeout 560 python3 -m pallas_kernels.bench --sections decode,prefill --ctx 4096 --batch 64,256 --page 64,128,256 \
      --prefill-cases 1x8192 --reps 20 --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -v '^{' ;;
  *) echo "usage: OUT=DIR bash scripts/gpu_kernels.sh prefill|ttft|profile|diagnose|decode" >&2; exit 2 ;;
esac
