#!/usr/bin/env bash
# On a machine with two GPUs (device tool kind nvidia-h100-x2 or nvidia-h200-x2), from the repo root: the
# tensor-parallel figures BENCHMARKS.md (Tensor parallelism) lists as pending. One stage per device call (each
# fits its 10 minutes), in this order; results and logs land in $OUT:
#   equivalence  TP=2 greedy tokens against TP=1, Qwen3-0.6B shapes cut to 4 layers: Mosaic kernels in bf16 and
#                the reference backend in f32, compression off and on (scripts/tp_equivalence.py)
#   load8b       peak device memory while loading Qwen3-8B shapes, TP=1 and TP=2, whole-then-shard against
#                straight into the shards (scripts/load_memory.py)
#   load32b      the same for Qwen3-32B shapes at TP=2 (whole-then-shard is expected not to fit one card)
#   decode       Qwen3-8B decode steps at TP=1 and TP=2, profiled: the scaling and the all-reduce (NCCL) time
#   throughput   the reasoning workload on Qwen3-32B shapes at TP=2 (full KV, then compressed; MODES to pick)
#   processes    two processes with one GPU each against one process (scripts/multi_process_check.py)
#   OUT=/tmp/out STAGES="equivalence load8b" bash scripts/gpu_tensor_parallel.sh
# Random bf16 checkpoints are written to $CKPT (default /tmp/ckpt; 64 GB for Qwen3-32B) by
# scripts/make_random_checkpoint.py (torch) and kept for the later stages of the same machine.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
stages=" ${STAGES:-equivalence} "
ckpt=${CKPT:-/tmp/ckpt}
has() { [[ "$stages" == *" $1 "* ]]; }
checkpoint() {  # shape [layers]
  local dir=$ckpt/$1${2:+-$2l}
  [ -f "$dir/config.json" ] || python3 scripts/make_random_checkpoint.py "$dir" --model-shape "$1" \
    ${2:+--num-layers $2} >&2
  echo "$dir"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if has equivalence; then
  small=$(checkpoint qwen3-0.6b 4)
  timeout 280 python3 scripts/tp_equivalence.py "$small" --tensor-parallel-size 2 --attention-backend mosaic \
    --dtype bfloat16 --json "$OUT/tp_equivalence_mosaic_bf16.json" 2>&1 | grep -v Warning | tee "$OUT/tp_equivalence.log"
  timeout 200 python3 scripts/tp_equivalence.py "$small" --tensor-parallel-size 2 --attention-backend reference \
    --dtype float32 --json "$OUT/tp_equivalence_reference_f32.json" 2>&1 | grep -v Warning | tee -a "$OUT/tp_equivalence.log"
fi
if has load8b; then
  timeout 560 python3 scripts/load_memory.py "$(checkpoint qwen3-8b)" --tensor-parallel-size 1 2 \
    --json "$OUT/load_memory_8b.json" 2>&1 | tee "$OUT/load_memory_8b.log"
fi
if has load32b; then
  timeout 580 python3 scripts/load_memory.py "$(checkpoint qwen3-32b)" --tensor-parallel-size 2 \
    --json "$OUT/load_memory_32b.json" 2>&1 | tee "$OUT/load_memory_32b.log"
fi
if has decode; then
  for tp in 1 2; do
    timeout 280 python3 -m zipage_jax.bench decode --model-shape qwen3-8b --batch ${BATCHES:-1 64 128} --ctx 1024 \
      --steps 64 --attention-backend auto --tensor-parallel-size $tp --profile --json "$OUT/decode_8b_tp$tp.json" \
      2>&1 | grep -v Warning | tee "$OUT/decode_8b_tp$tp.log" | tail -12
  done
fi
if has throughput; then
  model=$(checkpoint qwen3-32b)
  for mode in ${MODES:-full compressed}; do
    timeout 580 python3 -m zipage_jax.bench throughput --workload reasoning --model "$model" --modes "$mode" \
      --tensor-parallel-size 2 --requests 256 --page-size 128 --kv-budget-pages 4 --max-model-len 8192 \
      --kv-cache-memory-bytes 12000000000 --duration 40 --sample-interval-s 1 --json "$OUT/throughput_32b_tp2_$mode.json" \
      --png "$OUT/throughput_32b_tp2_$mode.png" 2>&1 | grep -v Warning | tee "$OUT/throughput_32b_tp2_$mode.log" | tail -8
  done
fi
if has processes; then
  timeout 300 python3 scripts/multi_process_check.py --gpu 2>&1 | tee "$OUT/multi_process.log"
fi
