#!/usr/bin/env bash
# The CUDA path of the torch backend checked on an NVIDIA GPU in one go (issue 13); writes
# docs/results-cuda.md. Under 8 minutes on an H200, the model build included: every stage runs under
# its own time limit inside a budget of BUDGET_S seconds (default 460), and the report says which
# stages finished. Stages: CUDA tests, exactness vs transformers (float32, bfloat16, every
# architecture), the random Qwen3-30B-A3B-shaped model (8 layers, 9.7 GB of bf16 experts), runahead
# vs sync vs prefetch-gate at 2/4/8/16 requests with the host store and the disk store (30% cache),
# single-request decode vs transformers, a profile of a group's time, then the report. Order: what the
# budget may cut goes last (the exactness table, which the CUDA tests already judge).
#
#   bench/cuda-check.sh                       # on a machine with an NVIDIA GPU
#   bench/cuda-check.sh --device cpu --quick  # the same stages, small, on CPU: proves the script works;
#                                             # writes .cuda-check/cpu-quick/results-cuda.md, not docs/
#
# Needs python3 with torch, transformers, safetensors and pytest (PYTHON=... to choose one); runs
# from the checkout (PYTHONPATH), no install. Work files go to .cuda-check/ (ignored by git), the
# model to $RUNAHEAD_CACHE (default .cuda-check/models). Where $OUT is set (the device tool), the
# report, the result rows and the logs are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--quick]" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
if [[ $DEVICE == cuda ]] && compgen -G ".whl/*.whl" >/dev/null; then  # carried to a GPU machine (bench/cuda-wheels.sh)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .cuda-check/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 3; }
  export PYTHONPATH="$PWD/.cuda-check/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RUNAHEAD_CACHE=${RUNAHEAD_CACHE:-$PWD/.cuda-check/models}
NAME=$DEVICE$([[ $QUICK == 1 ]] && echo -quick)
WORK=.cuda-check/$NAME
REPORT=$WORK/results-cuda.md
[[ $DEVICE == cuda && $QUICK == 0 ]] && REPORT=docs/results-cuda.md
rm -rf "$WORK" && mkdir -p "$WORK" "$RUNAHEAD_CACHE"

if [[ $QUICK == 1 ]]; then
  CONCURRENCY=2,4; STEPS=8; WARMUP=2; TOKENS=8; MODEL_ARGS=(--quick)
else
  # 8 first: the issue's targets are read at 8 requests, and the budget may cut the last points
  CONCURRENCY=8,2,4,16; STEPS=16; WARMUP=4; TOKENS=24; MODEL_ARGS=(--layers 8)
fi
# the disk store's points take as long as the disk does (1.6 GB/s on the first H200 machine: 1.7 s a
# step at 8 requests): fewer of them, shorter, so the host store's points fit the budget too
DISK_CONCURRENCY=$([[ $QUICK == 1 ]] && echo "$CONCURRENCY" || echo 8,2,4)
DISK_STEPS=$([[ $QUICK == 1 ]] && echo "$STEPS" || echo 8)
DISK_WARMUP=$([[ $QUICK == 1 ]] && echo "$WARMUP" || echo 2)
DTYPE=bfloat16
[[ $DEVICE == cpu ]] && DTYPE=float32  # bf16 matmuls crawl on some CPUs (docs/results-torch.md)

BUDGET_S=${BUDGET_S:-460}
[[ $DEVICE == cpu ]] && BUDGET_S=${BUDGET_S_CPU:-900} SLOW=3 || SLOW=1  # a shared 2-core CPU is slow
START=$(date +%s)
# stage NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of the budget), log to
# $WORK/NAME.log, record "NAME<TAB>exit status<TAB>seconds" in $WORK/stages.tsv
stage() {
  local name=$1 limit=$(($2 * SLOW)); shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    printf '%s\t124\t0\n' "$name" >>"$WORK/stages.tsv"
    echo "== $name: skipped, the budget is spent"
    return
  fi
  echo "== $name (at most ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$WORK/stages.tsv"
}

stage tests 150 "$PY" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider
stage model 100 "$PY" bench/cuda_model.py --device "$DEVICE" "${MODEL_ARGS[@]}"
MODEL=$(tail -n 1 "$WORK/model.log")
bench() {  # bench STORE CONCURRENCY STEPS WARMUP LIMIT_S
  stage "bench-$1" "$5" "$PY" -m runahead bench --backend torch --device "$DEVICE" --dtype "$DTYPE" \
    --model "$MODEL" --store "$1" --policy sync,prefetch-gate,runahead --cache-fraction 0.3 \
    --concurrency "$2" --steps "$3" --warmup-steps "$4" --out "$WORK/bench-$1" --quiet
}
# the disk store first: its point at 8 requests is where the issue's targets are read
bench disk "$DISK_CONCURRENCY" "$DISK_STEPS" "$DISK_WARMUP" 160
stage single 60 "$PY" bench/single_request.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
  --out "$WORK/single"
# where a group's time goes (compute thread wall and CPU, Python hot spots, torch's op table)
stage profile 60 "$PY" bench/cuda_profile.py --model "$MODEL" --device "$DEVICE" --tokens 16 \
  --out "$WORK/profile"
bench host "$CONCURRENCY" "$STEPS" "$WARMUP" 120
# last, what the budget may spare most: the tests above already judge exactness
stage exactness 80 "$PY" bench/exactness.py --device "$DEVICE" --dtype float32,bfloat16 --tokens "$TOKENS" \
  --out "$WORK/exactness.jsonl"

"$PY" - "$WORK/machine.json" "$DEVICE" "$QUICK" "$MODEL" <<'PYTHON'
import datetime, json, os, platform, subprocess, sys
import torch, transformers
out, device, quick, model = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
info = {"device": device, "quick": quick, "model": model, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__}
if device == "cuda" and torch.cuda.is_available():
    info["device_name"] = torch.cuda.get_device_name()
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except OSError:
        pass
else:
    info["device_name"] = "CPU: " + (platform.processor() or platform.machine())
if os.path.isdir(model):
    from runahead.store import MEMORY_FILESYSTEMS, filesystem_type
    info["filesystem"] = filesystem_type(model) or "unknown"
    info["memory_backed"] = info["filesystem"] in MEMORY_FILESYSTEMS
    files = [os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors")]
    info["weights_gb"] = sum(os.path.getsize(f) for f in files) / 1e9
json.dump(info, open(out, "w"), indent=1)
PYTHON
"$PY" bench/cuda_report.py --work "$WORK" --out "$REPORT" \
  --command "bench/cuda-check.sh$([[ $DEVICE != cuda ]] && echo " --device $DEVICE")$([[ $QUICK == 1 ]] && echo " --quick")"
echo "total $(($(date +%s) - START)) s"

if [[ -n ${OUT:-} ]]; then  # the device tool brings back what is under $OUT (at most 8 files)
  cp "$REPORT" "$OUT/results-cuda.md"
  tar czf "$OUT/cuda-check.tgz" -C "$WORK" . 2>/dev/null  # every row, log and table of the run
fi
