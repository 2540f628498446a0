#!/usr/bin/env bash
# The stores' readers side by side: Python reader threads (RUNAHEAD_NATIVE_READS=off) against the C
# threads (the default), three rounds in rotating order, at three torch points: the small model on
# the host store at 50% cache (compute-bound), behind a 0.6 GB/s link at 30% (link-bound), and the
# medium model behind a 3 GB/s link at 50%. 8 requests each. About 12 minutes on 2 cores.
# Rows: bench/results/native-reads/<point>-<off|on>-<round>/results.jsonl; summary:
#   python bench/ab_summary.py bench/results/native-reads
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/native-reads}
run() { # mode point args...
  local mode=$1 point=$2; shift 2
  RUNAHEAD_NATIVE_READS=$mode runahead bench --backend torch "$@" --concurrency 8 --out "$OUT/$point-$mode-$r" \
    > /dev/null
}
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="off on"; else order="on off"; fi
  for mode in $order; do
    run "$mode" host50 --model small --store host --cache-fraction 0.5 --steps 48 --warmup-steps 4 \
      --policy sync,runahead/grouping=bottleneck,runahead
    run "$mode" host06 --model small --store host --link-gbps 0.6 --cache-fraction 0.3 --steps 48 --warmup-steps 4 \
      --policy sync,runahead/grouping=bottleneck,runahead
    run "$mode" medhost3 --model medium --store host --link-gbps 3 --dtype auto --cache-fraction 0.5 --steps 32 \
      --warmup-steps 8 --policy sync,runahead
  done
done
