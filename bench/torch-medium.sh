#!/usr/bin/env bash
# The torch backend's benchmark targets (issues 3 and 11): the medium random Qwen3-MoE (~3 GB of bf16
# experts) on this CPU, experts read from its safetensors files with O_DIRECT, 64 decode steps after
# 8 warm-up steps, side by side in one run, then one request with every expert resident against
# transformers in float32 and bfloat16. Compute dtype auto: the faster of float32 and bfloat16 on
# this CPU, timed when the model opens. Writes bench/results/torch-medium-{8,2-4,single}/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
runahead bench --backend torch --model medium --store disk --dtype auto --policy sync,prefetch-gate,runahead \
  --concurrency 8 --cache-fraction 0.3,0.5,0.7 --steps 64 --warmup-steps 8 --out bench/results/torch-medium-8
runahead bench --backend torch --model medium --store disk --dtype auto --policy sync,prefetch-gate,runahead \
  --concurrency 2,4 --cache-fraction 0.3 --steps 64 --warmup-steps 8 --out bench/results/torch-medium-2-4
python bench/single_request.py --dtype auto --out bench/results/torch-medium-single
