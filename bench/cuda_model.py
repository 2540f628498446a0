"""The random model bench/cuda-check.sh measures, built once under $RUNAHEAD_CACHE; prints its folder.

Full size: Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width
768, top-8, vocabulary 151936) with ``--layers`` layers instead of 48, in bfloat16: 9.4 MiB per
expert, 9.7 GB of experts at 8 layers, so the link matters at 30% cache. Drawn on the GPU when there
is one. ``--quick``: the small demo model (8 layers x 32 experts, float32, ~70 MB) for the CPU test
of the script.
"""

from __future__ import annotations

import argparse

from runahead.medium import MEDIUM_CONFIG, build_cached, small_model

QWEN3_30B_A3B_SHAPES = {
    **MEDIUM_CONFIG,
    "hidden_size": 2048,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        print(small_model(progress=False))
        return
    config = {**QWEN3_30B_A3B_SHAPES, "num_hidden_layers": args.layers}
    name = f"qwen3-30b-a3b-shapes-{args.layers}l"
    print(build_cached(name, config, "bfloat16", progress=False, device=args.device))


if __name__ == "__main__":
    main()
