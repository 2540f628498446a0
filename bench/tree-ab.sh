#!/usr/bin/env bash
# One `runahead bench` command on two trees of the package, rounds alternating which goes first, so
# a shared machine's drift touches both alike. BEFORE is a folder holding an older `runahead` package
# (`git archive <rev> runahead | tar -x -C BEFORE`); "after" is this checkout's. The C libraries are
# cached by their source's digest, so both trees keep their own builds.
#   bench/tree-ab.sh BEFORE OUT POINT ROUNDS <runahead bench arguments...>
# Rows: OUT/POINT-<before|after>-<round>/results.jsonl; summary:
#   python bench/ab_summary.py OUT --variant before=<label> --variant after=<label>
# Example (the submit's GIL, docs/results-torch.md):
#   bench/tree-ab.sh /tmp/before bench/results/submit-gil host50 4 --backend torch --model small \
#     --store host --cache-fraction 0.5 --steps 96 --warmup-steps 4 --concurrency 8,4,2 \
#     --policy sync,runahead/grouping=bottleneck,runahead
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 BEFORE OUT POINT ROUNDS <bench arguments...>" >&2; exit 2; }
before=$(cd "$1" && pwd); out=$2; point=$3; rounds=$4; shift 4
[ -f "$before/runahead/__init__.py" ] || { echo "$before holds no runahead package" >&2; exit 2; }
after=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$after/.venv/bin/python}
mkdir -p "$out"
run() { # tree variant round
  PYTHONPATH=$1 "$python" -P -c 'import sys; from runahead.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench "${@:4}" --out "$out/$point-$2-$3" > "$out/$point-$2-$3.log" 2>&1 \
    || { echo "$point $2 round $3 failed: see $out/$point-$2-$3.log" >&2; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for variant in $order; do
    if [ "$variant" = before ]; then tree=$before; else tree=$after; fi
    run "$tree" "$variant" "$r" "$@"
    echo "round $r $variant done $(date +%T)"
  done
done
