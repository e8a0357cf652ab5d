#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root, with no XLA_*_MEM_FRACTION set: the engine sets jax's
# allocator to gpu_memory_utilization itself. The default engine's memory plan against what the device uses, the
# explicit-pool checks, then the decode benchmark that ran out of memory on an 80 GB card (its pool now from the
# card).
#   OUT=/tmp/out bash scripts/gpu_memory_plan.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset XLA_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_MEM_FRACTION
timeout "${PLAN_TIMEOUT:-420}" python3 scripts/gpu_memory_plan.py 2>&1 | grep -v "^ " | tee "$OUT/memory_plan.log" \
  | grep -E "plan|memory plan|in use|requests|kv_cache_memory_bytes|Error|warm-up"
timeout "${DECODE_TIMEOUT:-300}" python3 -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 256 \
  --ctx 1024 --steps 32 --attention-backend auto --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -15
