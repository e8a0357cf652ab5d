#!/usr/bin/env bash
# On one GPU, from the repo root: the engine's benchmarks on random Qwen3-8B (or 0.6B) weights, one STAGE per call
# (each fits a 10-minute call); reports, plots and logs land in $OUT. BENCHMARKS.md gives each stage's figures.
#   OUT=/tmp/out STAGE=workloads   bash scripts/gpu_engine.sh  # bench throughput, mixed then prefix, full vs compressed
#   OUT=/tmp/out STAGE=reasoning   bash scripts/gpu_engine.sh  # full vs compressed vs hybrid admission + the HF peer
#   OUT=/tmp/out STAGE=mixed       bash scripts/gpu_engine.sh  # the mixed workload under all three admissions
#   OUT=/tmp/out STAGE=prefix      bash scripts/gpu_engine.sh  # shared prompts: what prefix caching gives both modes
#   OUT=/tmp/out STAGE=default-budget bash scripts/gpu_engine.sh  # M=8 pages of 256, the pool of an 80 GB card
#   OUT=/tmp/out STAGE=scheduling  bash scripts/gpu_engine.sh  # async vs sync compression, admissions, under pressure
#   OUT=/tmp/out STAGE=compression bash scripts/gpu_engine.sh  # one compression of 64 and 256 requests vs a decode step
#   OUT=/tmp/out STAGE=decode      bash scripts/gpu_engine.sh  # decode steps at batch 1/64/256 (pool from the card's
#                                  # memory plan: no XLA_*_MEM_FRACTION), then what the per-step logprobs cost
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--model-shape qwen3-8b --requests 256 --max-model-len 8192 --sample-interval-s 1)
small=(--page-size 128 --kv-budget-pages 4 --kv-cache-memory-bytes 12000000000)
run() {  # name, seconds, arguments...
  local name=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout "$limit" python3 -m zipage_jax.bench throughput "${common[@]}" "$@" \
    --json "$OUT/$name.json" --png "$OUT/$name.png" 2>&1 | grep -v "^ " | tee "$OUT/$name.log" | tail -12
}
case "${STAGE:?set STAGE}" in
  reasoning) run reasoning 570 --workload reasoning "${small[@]}" --duration 30 \
               --modes full compressed compressed-hybrid --peer hf --peer-duration 15 --peer-timeout 60 ;;
  mixed) run mixed 570 --workload mixed "${small[@]}" --duration 30 \
           --modes full compressed compressed-hybrid compressed-constrained ;;
  prefix) run prefix 570 --workload prefix "${small[@]}" --duration 40 ;;
  workloads) run mixed 280 --workload mixed "${small[@]}" --duration 30
             run prefix 290 --workload prefix "${small[@]}" --duration 40 ;;
  default-budget) run default_budget 570 --workload reasoning --page-size 256 --kv-budget-pages 8 --duration 120 ;;
  scheduling)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 560 python3 -m zipage_jax.bench scheduling --model-shape qwen3-0.6b \
      --requests 64 --prompt-len 256 --output-len 1024 --kv-budget-pages 8 --page-size 64 \
      --num-gpu-pages-override 360 --attention-backend auto --max-num-batched-tokens 2048 --max-num-prefill-seqs 4 \
      --variants async-reserved async-hybrid sync-reserved async-constrained \
      --json "$OUT/scheduling.json" --png "$OUT/scheduling.png" 2>&1 | grep -v "^ " | tee "$OUT/scheduling.log" \
      | tail -12 ;;
  compression)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 560 python3 -m zipage_jax.bench compression --comp-batch 64,256 \
      --comp-reps 5 --json "$OUT/compression.json" 2>&1 | tee "$OUT/compression.log" | tail -25 ;;
  decode)
    unset XLA_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_MEM_FRACTION
    timeout 300 python3 -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 256 --ctx 1024 --steps 32 \
      --attention-backend auto --profile --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -20
    timeout 240 python3 -m zipage_jax.bench logprobs --json "$OUT/logprobs.json" 2>&1 | tee "$OUT/logprobs.log" ;;
  *) echo "usage: OUT=DIR STAGE=workloads|reasoning|mixed|prefix|default-budget|scheduling|compression|decode" \
       "bash scripts/gpu_engine.sh" >&2; exit 2 ;;
esac
