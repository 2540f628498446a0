#!/usr/bin/env bash
# Bottleneck grouping priced the way real backends price it (issue 11, fourth round): on the sim with
# its cost model hidden from the rule (bench/fit_in_sim.py), chat, 30% cache, 64 decode steps, 2-16
# requests, Thor and Mac, both paper models; beside the rule with the cost model and the paper's
# grouping. Writes bench/results/fit-in-sim/<profile>-<model>-<variant>.jsonl (~2 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/fit-in-sim
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--cache-fraction 0.3 --concurrency 2,4,8,16 --steps 64 --seed 0 --quiet)
for profile in thor mac-mini; do
  for model in qwen3.6-35b-a3b gemma4-26b-a4b; do
    for fit in model kinds one-line; do
      name=$([ "$fit" = model ] && echo cost-model || echo "fit-${fit/kinds/per-kind-experts}")
      python bench/fit_in_sim.py --fit "$fit" bench --model "$model" --profile "$profile" \
        --policy runahead "${common[@]}" --out "$tmp/$profile-$model-$name" &
    done
    runahead bench --model "$model" --profile "$profile" --policy runahead/grouping=opportunistic \
      --cache-fraction 0.3 --concurrency 2,4,8,16 --steps 64 --seed 0 --quiet \
      --out "$tmp/$profile-$model-paper-grouping"
    wait
    for run in "$tmp/$profile-$model"-*; do
      cp "$run/results.jsonl" "$out/$(basename "$run").jsonl"
    done
  done
done
