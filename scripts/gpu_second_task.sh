#!/usr/bin/env bash
# The second task (interleaved sums) on the GPU machine (device tool), from the repo root; one device call per
# stage, each under `timeout 570`, everything written to $OUT.
#
#   STAGE=train  OUT=... bash scripts/gpu_second_task.sh
#     Warm-starts the shipped model (it already adds LSD-first running sums; from scratch that took ~40 GPU
#     minutes) on batches 1/3 repeated addition, 2/3 interleaved sums, for TRAIN_SECONDS (300: ~1550 steps at the
#     first run's 185 ms/step, twice its 788), with the conclusion (the S: line and the box) weighted 10x; the
#     trainer then checks 200 test problems per task teacher-forced (greedy decoding is left to the eval).
#     Then the full-KV accuracy of the new checkpoint on each task's held-out split (`python -m zipage_jax.eval`,
#     PROBLEMS=400 each). Writes train.log (the loss and, per task, the conclusion's loss: the S: line was at
#     chance, ~2 nats a digit, in the first run), tiny-reasoner.tgz (the checkpoint and its train_log.json),
#     eval_<task>.json and eval.log (one summary line per task: "full KV ...: accuracy A over 400 questions").
#     INIT=outputs/second_task/tiny-reasoner.tgz (carried) continues from an earlier run's checkpoint instead, for
#     a second call when the interleaved_sums conclusion loss in train.log is still falling at the end.
#
#   STAGE=ablate PART=1..4 MODEL=outputs/second_task/tiny-reasoner.tgz OUT=... bash scripts/gpu_second_task.sh
#     Issue 31 item 2 on both tasks' test splits, 400 problems per cell, budgets M = 4,6,10,20 pages of 16
#     (~10/15/25/50 % of the mean output: 636 and ~578 tokens): the scoring components one at a time, R-KV-like,
#     window-only and a decay sweep, a few configurations per part (CONFIGS="name ..." picks others). MODEL is the
#     checkpoint of STAGE=train brought along with the device tool's `carry` (outputs/ is git-ignored). Writes
#     sweep_part<PART>.json (after each configuration) and sweep_part<PART>.log (the accuracy table).
#
#   STAGE=merge OUT=dir-with-the-parts bash scripts/gpu_second_task.sh   (here, on CPU: no device)
#     One table (sweep.md) and plot (sweep.png) of every part's results, relative to part 1's full KV.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
start=$(date +%s)
problems=${PROBLEMS:-400}
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - start) )); }
engine=(--page-size 16 --attention-backend reference --max-num-seqs 512 --num-gpu-pages-override 32768
        --compilation-cache-dir /tmp/xla-cache)

declare -A ablation=(
  [full-kv]=full-kv:compression=false [default]=default [no-global]=no-global:global_score=false
  [no-pooling]=no-pooling:pooling=false [no-redundancy]=no-redundancy:redundancy=off
  [rkv-like]=rkv-like:global_score=false,pooling=false,redundancy=full [window-only]=window-only:eviction_policy=window
  [decay-0.5]=decay-0.5:decay=0.5 [decay-0.65]=decay-0.65:decay=0.65 [decay-0.8]=decay-0.8:decay=0.8
  [decay-0.9]=decay-0.9:decay=0.9 [decay-0.95]=decay-0.95:decay=0.95
)
# "default" is the engine's default (decay 0.5 since the two-task ablation; decay-0.8 is the paper's choice)
parts=("" "full-kv default rkv-like window-only" "no-global no-pooling no-redundancy"
       "decay-0.65 decay-0.8 decay-0.9" "decay-0.95")

case "${STAGE:-train}" in
train)
  ckpt=$OUT/tiny-reasoner init=${INIT:-zipage_jax/assets/tiny-reasoner}
  if [ -f "$init" ]; then mkdir -p /tmp/init && tar -xzf "$init" -C /tmp/init && init=/tmp/init/tiny-reasoner; fi
  timeout $(( $(left) - 150 )) python3 scripts/train_tiny.py --out "$ckpt" --init "$init" \
    --tasks repeated_addition,interleaved_sums,interleaved_sums --batch 128 --lr 1e-3 --warmup 60 --steps 20000 \
    --answer-weight 10 --train-seconds "${TRAIN_SECONDS:-300}" --eval-problems 200 --greedy-samples 0 \
    2>&1 | grep -v Warning | tee "$OUT/train.log"
  [ -f "$ckpt/model.safetensors" ] || { echo "no checkpoint"; exit 1; }
  tar -czf "$OUT/tiny-reasoner.tgz" -C "$OUT" tiny-reasoner
  for task in interleaved_sums repeated_addition; do
    [ "$(left)" -lt 20 ] && { echo "deadline: skipping $task" | tee -a "$OUT/eval.log"; continue; }
    timeout "$(left)" python3 -m zipage_jax.eval --model "$ckpt" --data "synthetic:$task:test:$problems" \
      "${engine[@]}" --no-warmup --no-progress --output "$OUT/eval_$task.json" 2>&1 | grep -v Warning | tail -2 \
      | sed "s/^/$task: /" | tee -a "$OUT/eval.log"
  done
  rm -rf "$ckpt"
  ;;
ablate)
  model=${MODEL:-outputs/second_task/tiny-reasoner.tgz}
  if [ -f "$model" ]; then tar -xzf "$model" -C /tmp && model=/tmp/tiny-reasoner; fi
  [ -f "$model/model.safetensors" ] || { echo "MODEL: no checkpoint at $model"; exit 1; }
  part=${PART:-1}
  specs=()
  for name in ${CONFIGS:-${parts[$part]}}; do specs+=(--config "${ablation[$name]}"); done
  # --deadline-s: no configuration starts after it, so the last one started (~150 s at 400 problems) still ends
  timeout "$(left)" python3 -m zipage_jax.bench sweep --model "$model" --data "synthetic:test:$problems" \
    --data "synthetic:interleaved_sums:test:$problems" --budgets "${BUDGETS:-4,6,10,20}" "${engine[@]}" \
    --deadline-s $(( $(left) - ${CONFIG_SECONDS:-200} )) "${specs[@]}" --output "$OUT/sweep_part$part.json" \
    2>&1 | grep -v Warning | tee "$OUT/sweep_part$part.log"
  ;;
merge)
  python3 - "$OUT" <<'EOF'
import json, pathlib, sys
import matplotlib
matplotlib.use("Agg")
from zipage_jax.benchmarks.sweep import plot, table
out = pathlib.Path(sys.argv[1])
parts = [json.loads(p.read_text()) for p in sorted(out.glob("sweep_part*.json"))]
report = {**parts[0], "configs": {k: v for p in parts for k, v in p["configs"].items()},
          "results": [r for p in parts for r in p["results"]], "skipped": [s for p in parts for s in p["skipped"]]}
(out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
(out / "sweep.md").write_text(table(report) + "\n")
plot(report, out / "sweep.png")
print(table(report))
print("skipped (deadline):", ", ".join(report["skipped"]) or "none")
EOF
  ;;
*) echo "STAGE must be train, ablate or merge"; exit 2 ;;
esac
