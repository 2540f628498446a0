#!/usr/bin/env bash
# Bottleneck-aware grouping against the paper's on the agentic workload (the paper bench's Fig. 2
# setting, issue 11): 48 decode steps, 30% cache, 2-16 requests, Thor and Mac, both paper models.
# Writes bench/results/grouping-agentic-<profile>-<model>/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
for model in qwen3.6-35b-a3b gemma4-26b-a4b; do
  for profile in mac-mini thor; do
    runahead bench --backend sim --model "$model" --profile "$profile" --workload agentic --steps 48 \
      --cache-fraction 0.3 --concurrency 2,4,8,16 \
      --policy runahead/grouping=opportunistic,runahead/grouping=bottleneck \
      --seed 0 --quiet --out "bench/results/grouping-agentic-$profile-$model"
  done
done
