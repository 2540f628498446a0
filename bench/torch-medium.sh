#!/usr/bin/env bash
# The torch backend's benchmark targets (issues 3 and 11): the medium random Qwen3-MoE (~3 GB of bf16
# experts) on this CPU, experts read from its safetensors files with O_DIRECT, decode steps after
# 8 warm-up steps, side by side in one run, then one request with every expert resident against
# transformers. Writes bench/results/torch-medium${TAG}-{8,2-4,single}/results.jsonl.
#   DTYPE    compute dtype (default auto: the faster of float32 and bfloat16 here, timed at start)
#   POLICIES (default sync,prefetch-gate,runahead)   STEPS (default 64)   TAG (default none)
#   PYTHON   the interpreter (default python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DTYPE=${DTYPE:-auto}
POLICIES=${POLICIES:-sync,prefetch-gate,runahead}
STEPS=${STEPS:-64}
OUT=bench/results/torch-medium${TAG:-}
"$PY" -m runahead bench --backend torch --model medium --store disk --dtype "$DTYPE" --policy "$POLICIES" \
  --concurrency 8 --cache-fraction 0.3,0.5,0.7 --steps "$STEPS" --warmup-steps 8 --out "$OUT-8"
"$PY" -m runahead bench --backend torch --model medium --store disk --dtype "$DTYPE" --policy "$POLICIES" \
  --concurrency 2,4 --cache-fraction 0.3 --steps "$STEPS" --warmup-steps 8 --out "$OUT-2-4"
"$PY" bench/single_request.py --dtype "$DTYPE" --out "$OUT-single"
