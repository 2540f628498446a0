#!/usr/bin/env bash
# Bottleneck-aware grouping against the paper's (issue 11): sync, runahead/grouping=opportunistic and
# runahead/grouping=bottleneck side by side on the sim, Thor and Mac profiles, both paper models, chat,
# 2-16 requests, step barrier on; 30% cache over 256 steps, 10% and 70% over 128 steps.
# Writes bench/results/grouping-sim-<profile>-<model>-<cache>/results.jsonl; then
#   python bench/grouping_summary.py bench/results/grouping-sim-*/results.jsonl
# PROFILES="thor" (or "mac-mini") runs one profile, e.g. the two in parallel.
# To judge a change to the rule: POLICIES=runahead/grouping=bottleneck OUT=DIR (the rule's rows only,
# into DIR; ~1.5 min with both profiles in parallel on two cores), then
#   python bench/grouping_against.py DIR    # each point against the stored rows
set -euo pipefail
cd "$(dirname "$0")/.."
for profile in ${PROFILES:-thor mac-mini}; do
  for model in qwen3.6-35b-a3b gemma4-26b-a4b; do
    out="${OUT:-bench/results}/grouping-sim-$profile-$model"
    runahead bench --backend sim --model "$model" --profile "$profile" \
      --policy "${POLICIES:-sync,runahead/grouping=opportunistic,runahead/grouping=bottleneck}" \
      --concurrency 2,4,8,16 --cache-fraction 0.3 --steps 256 --workload chat --seed 0 --quiet --out "$out-0.3"
    runahead bench --backend sim --model "$model" --profile "$profile" \
      --policy "${POLICIES:-sync,runahead/grouping=opportunistic,runahead/grouping=bottleneck}" \
      --concurrency 2,4,8,16 --cache-fraction 0.1 --steps 128 --workload chat --seed 0 --quiet --out "$out-0.1"
    runahead bench --backend sim --model "$model" --profile "$profile" \
      --policy "${POLICIES:-sync,runahead/grouping=opportunistic,runahead/grouping=bottleneck}" \
      --concurrency 2,4,8,16 --cache-fraction 0.7 --steps 128 --workload chat --seed 0 --quiet --out "$out-0.7"
  done
done
