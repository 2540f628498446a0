#!/usr/bin/env bash
# Wheels for a GPU machine that cannot download (the device tool's H200 image: Python 3.12, torch,
# an older transformers, no structlog or gguf): saved to .whl/, which bench/cuda-check.sh installs
# from when it finds it. transformers is pinned to the version this checkout's venv runs, so the GPU's
# exactness is judged against the same reference as CI's (the image's 5.17 ignores gpt-oss's
# configured swiglu limit: our tiny gpt-oss differs from it, not from 5.25). numpy stays the image's.
#
#   bash bench/cuda-wheels.sh [PYTHON]    # PYTHON: the venv whose transformers to pin (.venv/bin/python)
#
# Then, in the device tool: carry [".whl"] and run `bash bench/cuda-check.sh` (about 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >>.git/info/exclude; }
rm -rf .whl && mkdir .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "transformers==$(version transformers)" "tokenizers==$(version tokenizers)" \
  "huggingface-hub==$(version huggingface-hub)" structlog gguf
rm -f .whl/numpy-*.whl
du -sh .whl
