#!/usr/bin/env bash
# The core runtime's benchmark targets (issue 2): every policy side by side on the sim backend,
# Thor and Mac profiles, both paper models, chat workload, 30% cache, 2-16 requests, 256 steps,
# step barrier on and off. Writes bench/results/core-sim-<profile>-<model>/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
for profile in thor mac-mini; do
  for model in qwen3.6-35b-a3b gemma4-26b-a4b; do
    runahead bench --backend sim --model "$model" --profile "$profile" \
      --policy sync,prefetch-gate,prefetch-history,runahead,runahead+prefetch \
      --concurrency 2,4,8,16 --cache-fraction 0.3 --steps 256 --workload chat --seed 0 \
      --step-barrier on,off --quiet --out "bench/results/core-sim-$profile-$model"
  done
done
# the runtime's own cost per job: zero-cost backend, all experts resident vs a 30% cache
runahead bench --backend sim --zero-cost --policy sync,runahead --concurrency 16 \
  --cache-fraction 1.0,0.3 --steps 64 --quiet --out bench/results/core-sim-overhead
