#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: the accuracy rows of the shipped model not yet measured
# (EVALS="policy budget ..."), the scheduling benchmark (async vs sync compression, hybrid vs constrained
# admission under memory pressure) and the compression-step benchmark, each bounded by a timeout.
#   OUT=/tmp/out bash scripts/gpu_bench_scheduling.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
common=(--data synthetic:test:500 --page-size 16 --attention-backend reference --max-num-seqs 256 --no-warmup
        --no-progress --compilation-cache-dir /tmp/xla-cache)
set -- ${EVALS:-}
while [ $# -ge 2 ]; do
  extra=(); [ "$1" != full ] && extra=(--compression --kv-budget-pages "$2" --eviction-policy "$1")
  timeout 110 python3 -m zipage_jax.eval "${common[@]}" "${extra[@]}" --output "$OUT/eval_$1_$2.json" 2>&1 | tail -2
  shift 2
done
timeout "${SCHED_TIMEOUT:-230}" python3 -m zipage_jax.bench scheduling --model-shape qwen3-0.6b --requests 96 \
  --prompt-len 256 --output-len 1280 --kv-budget-pages 8 --page-size 64 --num-gpu-pages-override 520 \
  --attention-backend auto \
  --compilation-cache-dir /tmp/xla-cache --json "$OUT/scheduling.json" --png "$OUT/scheduling.png" 2>&1 \
  | grep -v "^ " | tee "$OUT/scheduling.log" | tail -12
timeout "${COMP_TIMEOUT:-100}" python3 -m zipage_jax.bench compression --comp-batch 64,256 \
  --comp-reps 5 --json "$OUT/compression.json" 2>&1 | tee "$OUT/compression.log" | tail -25
if [ -n "${KERNELS:-}" ]; then  # attention kernels incl. the Triton ones (jax-triton carried as a wheel in .whl/)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
  timeout "${KERNEL_TIMEOUT:-90}" python3 -m pallas_kernels.bench --sections decode,prefill --ctx 4096 \
    --batch 64,256 --page 64,256 --prefill-cases 1x8192 --reps 10 --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -30
fi
