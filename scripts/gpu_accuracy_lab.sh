#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: train the shipped tiny model on both synthetic tasks
# (warm start from its checkpoint), then sweep accuracy against KV budget for the scoring ablations on both
# tasks' test splits, within DEADLINE seconds in all. Everything lands in $OUT (at most 5 files):
#   train.log, tiny-reasoner.tgz (the new checkpoint with its train_log.json), sweep.json, sweep.png, sweep.log
#   OUT=/tmp/out TRAIN_SECONDS=160 DEADLINE=355 PROBLEMS=48 bash scripts/gpu_accuracy_lab.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
start=$(date +%s)
ckpt=$OUT/tiny-reasoner
python3 scripts/train_tiny.py --out "$ckpt" --init zipage_jax/assets/tiny-reasoner \
  --tasks repeated_addition,interleaved_sums,interleaved_sums --batch 128 --lr 1e-3 --warmup 60 --steps 20000 \
  --train-seconds "${TRAIN_SECONDS:-175}" --eval-problems 200 --greedy-samples 8 2>&1 | tee "$OUT/train.log"
[ -f "$ckpt/model.safetensors" ] || { echo "no checkpoint"; exit 1; }
tar -czf "$OUT/tiny-reasoner.tgz" -C "$OUT" tiny-reasoner
n=${PROBLEMS:-48}
left=$(( ${DEADLINE:-380} - ($(date +%s) - start) - 40 ))  # the last configuration started must still finish
python3 -m zipage_jax.bench sweep --model "$ckpt" --data synthetic:test:"$n" --data synthetic:interleaved_sums:test:"$n" \
  --budgets "${BUDGETS:-4,6,9,19}" --page-size 16 --max-num-seqs 512 --num-gpu-pages-override 32768 \
  --attention-backend reference \
  --compilation-cache-dir /tmp/xla-cache --deadline-s "$left" \
  --config full-kv:compression=false --config default --config no-global:global_score=false \
  --config window-only:eviction_policy=window --config no-redundancy:redundancy=off \
  --config no-pooling:pooling=false --config rkv-like:global_score=false,pooling=false,redundancy=full \
  --config decay-0.5:decay=0.5 \
  --output "$OUT/sweep.json" --plot "$OUT/sweep.png" 2>&1 | grep -v Warning | tee "$OUT/sweep.log"
rm -rf "$ckpt"
