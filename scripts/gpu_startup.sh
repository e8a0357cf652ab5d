#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root: start-up of the public API (`bench startup`) on a random
# Qwen3-8B checkpoint with the default configuration, cold (empty caches, weights in the page cache) then warm (the
# same cache), compressed and full KV. With BEFORE=DIR (an older tree's zipage_jax + pallas_kernels, carried) that
# tree's compressed runs come first, in the same call, for a before/after comparison. With EARLY=1 each mode also
# starts cold with --ready-early (ready once a light load's programs are, the rest compiling in the background).
# With ONLY_EARLY=1 (and EARLY=1) the cold all-programs-first start is skipped and the warm start uses that cache.
#   OUT=/tmp/out [BEFORE=.before] [EARLY=1 [ONLY_EARLY=1]] bash scripts/gpu_startup.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
CKPT=${CKPT:-/tmp/qwen3-8b}
[ -f "$CKPT/config.json" ] || PYTHONPATH=. python3 scripts/make_random_checkpoint.py "$CKPT" --model-shape qwen3-8b 2>&1 | tail -1
run() {  # label, tree, mode, cache directory, more options
  local label=$1 tree=$2 mode=$3 cache=$4 options=("${@:5}")
  [ "$mode" = compressed ] && options+=(--compression)
  # from inside the tree: `python -m` puts the working directory first on the path, ahead of PYTHONPATH
  (cd "$tree" && PYTHONPATH=. timeout "${RUN_TIMEOUT:-240}" python3 -m zipage_jax.bench startup --model "$CKPT" \
    "${options[@]}" --compilation-cache-dir "$cache" --workload 8 --json "$OUT/startup.jsonl") > "$OUT/$label.log" 2>&1
  echo "$label: $(grep -E 'ready in' "$OUT/$label.log" | tail -1)$(grep -E 'Error' "$OUT/$label.log" | tail -1)"
  grep -E "^ready early|^LLM\(\) by phase" "$OUT/$label.log"
  grep -E "KV pool" "$OUT/$label.log" | head -1 | cut -c1-400
}
if [ -n "${BEFORE:-}" ]; then
  run before-compressed-cold "$BEFORE" compressed /tmp/cache-before
  run before-compressed-warm "$BEFORE" compressed /tmp/cache-before
fi
for mode in ${MODES:-compressed full}; do
  [ -n "${EARLY:-}" ] && run "after-$mode-cold-early" . "$mode" "/tmp/cache-early-$mode" --ready-early
  if [ -n "${ONLY_EARLY:-}" ]; then  # the warm start reuses the ready-early run's cache (complete when it ends)
    run "after-$mode-warm" . "$mode" "/tmp/cache-early-$mode"
    continue
  fi
  run "after-$mode-cold" . "$mode" "/tmp/cache-after-$mode"
  run "after-$mode-warm" . "$mode" "/tmp/cache-after-$mode"
done
