#!/usr/bin/env bash
# Issue 11 on the torch CPU backend with a steady link: the medium model, CACHE (default 30%) cache, 2/4/8 requests,
# sync against runahead (bottleneck grouping) and the paper's grouping, every expert read paced to a
# serial link of GBPS GB/s (`--link-gbps`, store.LinkCap). ROUNDS rounds, the policy order reversed
# in every other one (what runs first meets a colder machine). Writes
# bench/results/torch-medium-cap-<TAG>-r<N>/results.jsonl; then
#   python bench/grouping_summary.py bench/results/torch-medium-cap-<TAG>-r*/results.jsonl
# STORE=host (default; every expert in memory, the cap is the link) or STORE=disk (O_DIRECT reads of
# the files; keep GBPS below the disk's own rate, or the disk sets the pace). POLICIES=sync,runahead
# leaves the paper's grouping out (it halves the run time on a slow link). CONCURRENCY and CACHE take
# lists (CACHE=0.5,0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
STORE=${STORE:-host}
GBPS=${GBPS:-1.5}
TAG=${TAG:-$STORE$GBPS}
POLICIES=${POLICIES:-sync,runahead,runahead/grouping=opportunistic}
REVERSED=$(echo "$POLICIES" | tr ',' '\n' | tac | paste -sd, -)
for round in $(seq 1 "${ROUNDS:-2}"); do
  if (( round % 2 )); then ORDER=$POLICIES; else ORDER=$REVERSED; fi
  runahead bench --backend torch --model medium --store "${STORE:-host}" --link-gbps "${GBPS:-1.5}" \
    --dtype auto --policy "${ORDER:-sync,runahead}" --concurrency "${CONCURRENCY:-2,4,8}" \
    --cache-fraction "${CACHE:-0.3}" --steps 32 --warmup-steps 8 --quiet \
    --out "bench/results/torch-medium-cap-${TAG:-host1.5}-r${round:-1}"
done
