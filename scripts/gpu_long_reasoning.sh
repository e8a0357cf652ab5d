#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root, one device call (under 10 minutes, start-ups included):
#   OUT=/tmp/out bash scripts/gpu_long_reasoning.sh
# The paper's regime (bench throughput --workload long-reasoning): KV budget M=8 pages of 256 = 2048 tokens, short
# prompts with a shared system prefix, outputs log-normal with ~6.4 budgets on average up to 32k tokens, a closed
# loop of SEQS requests in the engine (each finished one replaced by the next; SEQS = --max-num-seqs, default 384 on
# an H200, whose pool holds 322 compressed requests (max_num_seqs 256 would cap them: `python -m zipage_jax.bench
# concurrency`), 192 on an 80 GB card, whose pool holds ~159),
# random bf16 weights of Qwen3-8B's shapes, the KV pool of the whole card (--gpu-memory-utilization 0.9), full KV
# then compressed in one process. AGED=1 (the default) enters the loop at its steady state (--aged-start: the first
# SEQS requests caught mid-trace, their generated part prefilled, 8192 prompt tokens a step to prefill it sooner)
# so that full KV's window is its steady state, not a wave of short contexts growing together; AGED=0: the wave.
# --time-budget 540 gives each mode an equal share of what is left when it starts (start-up included);
# timeout 590 stops the command whatever happens. MODES="compressed" BUDGET=300: compressed mode alone (its compression
# share, say), in half the time. In $OUT: long_reasoning.json (rewritten after each mode),
# long_reasoning.png (throughput with the steady windows shaded, requests, occupancy, pages per request) and
# long_reasoning.log (everything printed; its tail is echoed here). PEER=1: first HF transformers' continuous batching
# on the same first SEQS requests (aged too), its window PEER_SECONDS (80) long, in a subprocess before jax starts;
# the modes then share what is left of BUDGET.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# the loop a little above compressed mode's capacity (pool / (M+1): ~322 on an H200, ~159 on an 80 GB card), so that
# few aged requests wait (their prefill inside the window weighs on the mode that finishes more requests)
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SEQS=${SEQS:-$([ "${memory_mib:-0}" -gt 100000 ] && echo 384 || echo 192)}
echo "card memory ${memory_mib} MiB: a closed loop of $SEQS"
peer=()
[ "${PEER:-0}" = 1 ] && peer=(--peer hf --peer-requests "$SEQS" --peer-duration "${PEER_SECONDS:-80}" --peer-timeout 200)
aged=()
[ "${AGED:-1}" = 1 ] && aged=(--aged-start --max-num-batched-tokens 8192)
timeout 590 python3 -m zipage_jax.bench throughput --workload long-reasoning --model-shape qwen3-8b "${aged[@]}" \
  "${peer[@]}" --modes ${MODES:-full compressed} --gpu-memory-utilization 0.9 --max-num-seqs "$SEQS" --concurrency "$SEQS" \
  --time-budget "${BUDGET:-540}" --sample-interval-s 1 \
  --json "$OUT/long_reasoning.json" --png "$OUT/long_reasoning.png" 2>&1 | tee "$OUT/long_reasoning.log" | tail -18
