#!/usr/bin/env bash
# The mlx backend's benchmark on a Mac (Apple silicon, Metal): the same measurement as
# docs/results-mlx.md made here on MLX's CPU build. runahead vs sync vs prefetch-gate at 2/4/8
# requests with 30% of the experts cached and read from the SSD (F_NOCACHE, macOS's O_DIRECT), then
# single-request decode with every expert resident against mlx_lm's own stream_generate.
#
#   pip install -e '.[mlx]'
#   bash bench/mlx-mac.sh                      # the medium random 4-bit model (built once, ~1 min)
#   bash bench/mlx-mac.sh ~/models/Qwen3-30B-A3B-4bit   # or an mlx-community checkpoint of yours
#
# Writes bench/results/mlx-mac/{results,single}.jsonl and prints the table of docs/results-mlx.md.
# What to expect (not measured: no Mac was available to this project): Metal computes a decode step
# tens of times faster than MLX's CPU build here, while the SSD moves 3-7 GB/s, so the link, not the
# compute, limits the step at 30% cache. The overlap limit (compute + fetch) / max(compute, fetch) of
# sync's own run then rises toward 2x, and runahead's gain over sync should grow with it (the
# paper's M-series Mac: 1.01-1.38x over the best prefetcher at 2-16 requests). Single-request decode
# with every expert resident should match mlx_lm (ratio ~1.0): the same kernels run. Close other
# apps: the page cache and the GPU are shared, and one number moves by 10-30% from run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-}"
python bench/mlx_medium.py --out bench/results/mlx-mac --device gpu --steps 32 --repeats 3 \
  ${MODEL:+--model "$MODEL"}
