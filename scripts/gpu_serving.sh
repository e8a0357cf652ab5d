#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root, with the server's wheels carried in .whl (the machine has
# no fastapi/uvicorn/pydantic): `python -m zipage_jax.serve` on a random Qwen3-8B checkpoint, driven by
# `bench serving` as a user's client would. Compressed: closed-loop streams (vs the offline engine on the same
# requests), request rates, a soak with client cancellations; then full KV at the same rates. A small KV pool
# (POOL bytes) puts full KV under the memory pressure that long reasoning outputs bring.
#   OUT=/tmp/out bash scripts/gpu_serving.sh
#   OUT=/tmp/out STAGE=streams bash scripts/gpu_serving.sh   # only the closed-loop streams against the offline engine
#   OUT=/tmp/out STAGE=rates POOL=1500000000 RATES="16 32" REQUESTS=192 bash scripts/gpu_serving.sh
#       # only the request rates of both modes, with a pool small enough that full KV saturates (~10k tokens: at
#       # 8 req/s ~35 requests of ~250 live tokens still fit) and compressed does not: the rate each sustains at
#       # p99 TTFT <= 2 s (H100, 2026-12-06: full KV holds 8 and not 12, compressed 16 and not 32; saturated,
#       # 6.8 vs 9.8 req/s: 1.44x, with outputs clipped by LEN=1024 to 3.5 budgets)
#   OUT=/tmp/out STAGE=rates POOL=1500000000 LEN=2048 RATES="6 9 12 18" REQUESTS=192 bash scripts/gpu_serving.sh
#       # the same with outputs 4.1 budgets (less clipping): full KV's mean live context grows, compressed's
#       # stays M + 1 pages (H100, 2026-12-06: full KV holds 4 req/s and not 6, compressed 12 and not 18)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
CKPT=${CKPT:-/tmp/qwen3-8b}
[ -f "$CKPT/config.json" ] || python3 scripts/make_random_checkpoint.py "$CKPT" --model-shape qwen3-8b 2>&1 | tail -1
PAGE=${PAGE:-32} BUDGET=${BUDGET:-4} LEN=${LEN:-1024} POOL=${POOL:-4000000000} REQUESTS=${REQUESTS:-64} STREAMS=${STREAMS:-256}
engine=(--model "$CKPT" --page-size "$PAGE" --max-model-len "$LEN" --kv-cache-memory-bytes "$POOL"
        --compilation-cache-dir /tmp/zipage-cache)
client=(--workload reasoning --page-size "$PAGE" --budget-tokens $((PAGE * BUDGET)) --vocab-size ${VOCAB:-151936}
        --max-model-len "$LEN" --slo-ttft 2 --slo-tpot 0.1)
serve() {  # mode, engine options...: start a server, wait until /health answers 200 (or it dies), then until the
  # programs of larger batches, compiling in the background, are ready too (measurements are of the steady state)
  local mode=$1; shift
  python3 -m zipage_jax.serve "${engine[@]}" "$@" --port 8000 --log-level warning > "$OUT/server_$mode.log" 2>&1 &
  SERVER=$!
  local start=$SECONDS
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do
    kill -0 $SERVER 2> /dev/null || { echo "$mode server died"; tail -5 "$OUT/server_$mode.log"; return 1; }
    sleep 0.2
  done
  echo "$mode server ready after $((SECONDS - start))s"
  until [ "$(curl -sf http://127.0.0.1:8000/health)" = '{"status":"ok"}' ]; do sleep 0.5; done
  echo "$mode server: every program ready after $((SECONDS - start))s"
}
bench() {  # name, seconds, bench serving arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m zipage_jax.bench serving "${client[@]}" "$@" --json "$OUT/$name.json" 2>&1 \
    | grep -v "^ " | tee "$OUT/$name.log" | grep -E "rate|concurrency|soak|offline|Error"
}
stop() { kill -INT $SERVER; wait $SERVER; }

if serve compressed --compression --kv-budget-pages "$BUDGET"; then
  [ "${STAGE:-all}" = rates ] || bench compressed_streams 120 --rates --requests "$STREAMS" --concurrency "$STREAMS"
  [ "${STAGE:-all}" = streams ] || bench compressed_rates 150 --rates ${RATES:-4 8 16} --requests "$REQUESTS"
  [ "${STAGE:-all}" = all ] && bench compressed_soak 120 --rates --requests "$REQUESTS" --soak ${SOAK:-45} --soak-rate 8 --cancel-prob 0.3 \
    --server-pid $SERVER --drain-timeout 60
  stop
fi
[ "${STAGE:-all}" = rates ] || bench offline_streams 150 --offline "${engine[@]}" --compression --kv-budget-pages "$BUDGET" --requests "$STREAMS" \
  --concurrency "$STREAMS"
[ "${STAGE:-all}" = streams ] && exit 0
if serve full; then
  bench full_rates 150 --rates ${RATES:-4 8 16} --requests "$REQUESTS"
  stop
fi
