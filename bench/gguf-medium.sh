#!/usr/bin/env bash
# The medium random Qwen3-MoE (16 layers x 64 experts, top-8, hidden 1024, expert width 512) as Q4_0
# GGUF (runahead convert) beside its bf16 safetensors folder, in one run: 8 requests, 30% of the
# experts cached, experts read from disk (O_DIRECT), sync / prefetch-gate / runahead; then single-request
# decode against llama.cpp (2 threads) on the same GGUF. Needs llama-cpp-python (FACTS.md's wheel).
# Writes bench/results/gguf-medium/{q4_0,q4_0-dequant,bf16}/results.jsonl and bench/results/gguf-peer/medium.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${GGUF:-/tmp/gguf-medium/medium-Q4_0.gguf}
STEPS=${STEPS:-24}
python -c "from runahead.medium import medium_model; medium_model()"  # built once
mkdir -p "$(dirname "$GGUF")"
[ -f "$GGUF" ] || python -m runahead convert "${RUNAHEAD_CACHE:-$HOME/.cache/runahead}/medium-qwen3-moe" "$GGUF" --type q4_0
# q4_0: the products on the stored bytes (runahead.models.qkernel); q4_0-dequant: the kernel switched off,
# each expert dequantized into float32 per group (the path before it, and where no kernel can be built)
for what in "q4_0 $GGUF on" "q4_0-dequant $GGUF off" "bf16 medium on"; do
  set -- $what
  RUNAHEAD_QUANT_KERNEL=$3 python -m runahead bench --backend torch --model "$2" --store disk --dtype float32 \
    --policy sync,prefetch-gate,runahead --concurrency 8 --cache-fraction 0.3 --steps "$STEPS" --warmup-steps 4 \
    --quiet --out "bench/results/gguf-medium/$1"
done
python bench/gguf_peer.py medium "$GGUF" --steps 32 --twin medium --out bench/results/gguf-peer
