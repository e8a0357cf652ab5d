#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: continue training the shipped tiny model from its
# checkpoint for TRAIN_SECONDS, then evaluate the result on the synthetic test split with full KV and under
# compression (zipage and window policies at several budgets) until DEADLINE seconds have passed.
#   OUT=/tmp/out TRAIN_SECONDS=380 DEADLINE=570 bash scripts/gpu_train_and_eval.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
start=$(date +%s)
ckpt=$OUT/tiny-reasoner
python3 scripts/train_tiny.py --out "$ckpt" --init zipage_jax/assets/tiny-reasoner --batch 128 --lr 1e-3 \
  --warmup 100 --steps 20000 --train-seconds "${TRAIN_SECONDS:-380}" --eval-problems 500 --greedy-samples 32 \
  2>&1 | tee "$OUT/train.log"
common=(--model "$ckpt" --data synthetic:test:"${PROBLEMS:-500}" --page-size 16 --attention-backend reference
        --max-num-seqs 256 --no-warmup --no-progress --compilation-cache-dir /tmp/xla-cache)
for cfg in "zipage 9" "window 9" "full 0" "zipage 4" "window 4" "zipage 19" "window 19"; do
  set -- $cfg
  left=$(( ${DEADLINE:-570} - ($(date +%s) - start) ))
  [ "$left" -lt 30 ] && { echo "deadline: skipping $cfg"; continue; }
  extra=(); [ "$1" != full ] && extra=(--compression --kv-budget-pages "$2" --eviction-policy "$1")
  timeout "$left" python3 -m zipage_jax.eval "${common[@]}" "${extra[@]}" --output "$OUT/eval_$1_$2.json" \
    2>&1 | tail -4 | tee -a "$OUT/eval.log"
done
