"""What a GGUF expert costs in the cache and on the link: Q4_0 / Q8_0 slots beside bf16 ones, one run.

Builds one random Qwen3-MoE with the medium model's expert shapes (hidden 1024, expert width 512,
64 experts per layer; ``--layers`` of them, small vocabulary), saves it as bf16 safetensors and
writes it as GGUF at Q8_0 and Q4_0 (tests/ggufhelpers.py: llama.cpp's layout). For each it reports
the bytes of one cache slot and experts per GiB of cache (bf16 slots, the CUDA default, and float32
ones, the CPU's; a GGUF's slots hold its own bytes either way), reads every expert once with the
O_DIRECT disk store: payload bytes per expert, bytes actually read (alignment included) and
milliseconds per expert (the files are fresh: O_DIRECT bypasses the page cache; where the
filesystem refuses O_DIRECT the row says so and the times measure memory), and times the compute
side of one expert (see :func:`measure`).

    PYTHONPATH=$PWD:tests python bench/gguf_bytes.py --out DIR [--layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from runahead.models.loader import load_model
from runahead.store import DiskStore, SlotPool


def measure(path: Path, label: str) -> dict[str, Any]:
    """Slot size and one O_DIRECT read of every expert of the model at ``path``; then the compute
    side: milliseconds to turn one slot into float32 weights (``expert_weights``: dequantize, or
    widen bf16) and to run one expert on 1 and on 8 rows, float32 (medians of 20)."""
    model, layout = load_model(path, dtype=torch.float32)
    pool = SlotPool.for_layout(1, layout, dtype=torch.float32)
    sizes = {
        name: SlotPool.for_layout(1, layout, dtype=dtype).nbytes
        for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32))
    }  # a GGUF's slots hold its bytes whatever the compute dtype
    with DiskStore(layout) as store:

        async def read_all() -> float:
            start = time.perf_counter()
            for key in sorted(layout.ranges):
                await store.read_into(*key, pool.slot(0))
            return time.perf_counter() - start

        seconds = asyncio.run(read_all())
        experts = len(layout.ranges)
        slot = pool.slot(0)
        rows = {n: torch.randn(n, layout.hidden_size) for n in (1, 8)}
        widen = _median_ms(lambda: model.expert_weights(0, slot, torch.float32))
        weights = model.expert_weights(0, slot, torch.float32)
        compute = {n: _median_ms(lambda x=x: model.run_expert(weights, x)) for n, x in rows.items()}
        return {
            "format": label,
            "slot_bytes_bf16_compute": sizes["bf16"],
            "slot_bytes_f32_compute": sizes["f32"],
            "experts_per_gib_bf16_compute": round(2**30 / sizes["bf16"], 1),
            "experts_per_gib_f32_compute": round(2**30 / sizes["f32"], 1),
            "payload_bytes_per_expert": store.bytes_read // experts,
            "io_bytes_per_expert": store.io_bytes // experts,
            "ms_per_expert": round(1000 * seconds / experts, 3),
            "to_float32_ms": widen,
            "expert_1_row_ms": compute[1],
            "expert_8_rows_ms": compute[8],
            "direct": store.direct,
            "memory_backed": store.memory_backed,
        }


def _median_ms(fn: Any, repeats: int = 20) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return round(1000 * sorted(times)[len(times) // 2], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from ggufhelpers import write_gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    hf = args.out / "hf-bf16"
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=2048,
        hidden_size=1024,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        intermediate_size=2048,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hf)
    rows = [measure(hf, "bf16 safetensors")]
    for kind in ("Q8_0", "Q4_0"):
        rows.append(measure(write_gguf(hf, args.out / f"model-{kind}.gguf", kind), f"{kind} GGUF"))
    with (args.out / "results.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row))


if __name__ == "__main__":
    main()
