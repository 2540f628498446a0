"""Greedy tokens and logits of the torch backend against transformers, every architecture, one device.

For each tiny random model (tests/modelhelpers.py) and each dtype: 4 requests at once through the
runtime (runahead, 8 cache slots: experts evicted and refetched) against transformers on the same
device. Writes OUT (JSONL, one row per architecture and dtype) and prints a table.

    python bench/exactness.py --device cuda --dtype float32,bfloat16 --out exactness.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from modelhelpers import ARCHS, build_tiny_model, compare_with_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch, args.out.open("w") as sink:
        for arch in ARCHS:
            try:
                path = build_tiny_model(arch, Path(scratch) / arch)
            except (ValueError, KeyError) as err:  # an older transformers without this architecture
                print(f"{arch:<10} skipped: transformers {transformers.__version__} cannot build it: {err}")
                sink.write(json.dumps({"arch": arch, "device": args.device, "skipped": str(err)}) + "\n")
                continue
            for name in args.dtype.split(","):
                found = compare_with_transformers(
                    path, device=args.device, dtype=getattr(torch, name), tokens=args.tokens
                )
                row = {"arch": arch, "device": args.device, "dtype": name, **found}
                sink.write(json.dumps(row) + "\n")
                sink.flush()  # rows so far survive a time limit
                print(
                    f"{arch:<10} {name:<9} tokens equal: {row['tokens_equal']!s:<5} "
                    f"first divergence: {row['first_divergence']!s:<4} "
                    f"max |logit - fp32 transformers|: ours {row['logit_error']:.2e}, "
                    f"transformers {name} {row['reference_error']:.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
