#!/usr/bin/env bash
# The paper's main architecture on the torch backend (issue 8): a medium random Qwen3.6-shaped model
# (linear attention with a per-request recurrent state, shared expert; ~3 GB of bf16 experts) on this
# CPU, experts read with O_DIRECT, sync vs prefetch-gate vs runahead at 2/4/8 requests and 30% cache,
# side by side in one run. Writes bench/results/torch-qwen36-medium/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${RUNAHEAD_CACHE:-$HOME/.cache/runahead}/medium-qwen3.6"
python bench/build_qwen36_medium.py "$model"
runahead bench --backend torch --model "$model" --store disk --policy sync,prefetch-gate,runahead \
  --concurrency 2,4,8 --cache-fraction 0.3 --steps 32 --warmup-steps 4 --out bench/results/torch-qwen36-medium
