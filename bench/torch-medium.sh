#!/usr/bin/env bash
# The torch backend's benchmark targets (issue 3): the medium random Qwen3-MoE (~3 GB of bf16
# experts) on this CPU, experts read from its safetensors files with O_DIRECT, 64 decode steps after
# 8 warm-up steps, side by side in one run. Writes bench/results/torch-medium*/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
runahead bench --backend torch --model medium --store disk --policy sync,prefetch-gate,runahead \
  --concurrency 8 --cache-fraction 0.3,0.5,0.7 --steps 64 --warmup-steps 8 --out bench/results/torch-medium-8
runahead bench --backend torch --model medium --store disk --policy sync,prefetch-gate,runahead \
  --concurrency 2,4 --cache-fraction 0.3 --steps 64 --warmup-steps 8 --out bench/results/torch-medium-2-4
python bench/single_request.py --out bench/results/torch-medium-single
