#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: the throughput campaign's runs still to measure, one
# STAGE per device call (each fits the 10-minute limit); results land in $OUT as JSON + PNG + log per run.
#   OUT=/tmp/out STAGE=reasoning bash scripts/gpu_throughput_campaign.sh   # full vs compressed vs hybrid admission + HF peer
#   OUT=/tmp/out STAGE=mixed     bash scripts/gpu_throughput_campaign.sh   # admission matters: all three admissions
#   OUT=/tmp/out STAGE=prefix    bash scripts/gpu_throughput_campaign.sh   # prefix caching matters
#   OUT=/tmp/out STAGE=workloads bash scripts/gpu_throughput_campaign.sh  # mixed then prefix, full vs compressed
#   OUT=/tmp/out STAGE=default-budget bash scripts/gpu_throughput_campaign.sh  # M=8 pages of 256, 80 GB-card pool
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
common=(--model-shape qwen3-8b --requests 256 --max-model-len 8192 --sample-interval-s 1)
small=(--page-size 128 --kv-budget-pages 4 --kv-cache-memory-bytes 12000000000)
run() {  # name, seconds, arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m zipage_jax.bench throughput "${common[@]}" "$@" --json "$OUT/$name.json" \
    --png "$OUT/$name.png" 2>&1 | grep -v "^ " | tee "$OUT/$name.log" | tail -12
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
  *) echo "unknown STAGE $STAGE"; exit 2 ;;
esac
