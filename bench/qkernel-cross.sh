#!/usr/bin/env bash
# The stored-expert kernel's portable body as arm64 (NEON) builds it, checked under emulation.
# Needs zig (pip install ziglang: a C cross compiler) and qemu-user (apt install qemu-user-static).
# Compiles runahead/models/qkernel.c with bench/qkernel_check.c for aarch64-linux (static, -O3, the flags
# the runtime uses), runs the check under qemu-aarch64 (correctness only: emulated time means nothing),
# and counts the NEON fused multiply-adds in the product's code (the compiler vectorized it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
zig=(python3 -m ziglang cc -target aarch64-linux-musl -O3 -pthread)
"${zig[@]}" -static bench/qkernel_check.c runahead/models/qkernel.c -o "$out/check" -lm
qemu-aarch64-static "$out/check"
"${zig[@]}" -S runahead/models/qkernel.c -o "$out/qkernel.s" 2>/dev/null
echo "NEON vector fmla/fmul instructions in the arm64 build: $(grep -cE '\s(fmla|fmul)\s+v[0-9]+\.4s' "$out/qkernel.s")"
rm -rf "$out"
