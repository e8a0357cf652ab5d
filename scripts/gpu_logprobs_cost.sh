#!/usr/bin/env bash
# On one GPU (device tool, any kind), from the repo root: what the logprobs every step now computes cost.
#   1. scripts/logprobs_cost.py: per-row logprob + rank + top-20 of [B, 151936] f32 logits at B = 1, 64, 256
#      against a greedy step's own sampling (argmax + logsumexp) and against jax.lax.top_k(k=20) (a sort on
#      GPU); and one 128-row dispatch of the prompt-logprobs program at Qwen3-8B's hidden size.
#   2. bench decode at Qwen3-8B shapes, batch 1 and 64 (the decode step includes the top-20 now): compare the
#      tok/s with BENCHMARKS.md's rows of the same card, or rerun this script's stage 2 on the parent commit.
#   OUT=/tmp/out bash scripts/gpu_logprobs_cost.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 python3 scripts/logprobs_cost.py --json "$OUT/logprobs_cost.json" 2>&1 | tee "$OUT/logprobs_cost.log"
timeout 300 python3 -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 --attention-backend mosaic \
  --json "$OUT/decode_with_logprobs.json" 2>&1 | tail -20 | tee "$OUT/decode_with_logprobs.log"
