"""Single-request decode speed with every expert resident: runahead's torch backend vs transformers.

Same medium model, same CPU, same float32 compute, greedy, one request; both warmed up first.
Writes OUT/results.jsonl with tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from runahead.medium import medium_model
from runahead.torchbench import TorchPoint, run_torch_point

STEPS = 32


def transformers_tokens_per_s(path: str, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    prompt = torch.tensor([[11]])
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm up
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        return STEPS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    path = str(medium_model())
    ours = run_torch_point(
        TorchPoint(path, "runahead", 1, 1.0, STEPS, store="host", warmup_steps=4, preload=True)
    )
    rows = [
        {
            "system": "runahead torch backend (float32, all experts resident)",
            "tokens_per_s": ours["tokens_per_s"],
        },
        {
            "system": "transformers generate (float32)",
            "tokens_per_s": transformers_tokens_per_s(path, torch.float32),
        },
        {
            "system": "transformers generate (bfloat16)",
            "tokens_per_s": transformers_tokens_per_s(path, torch.bfloat16),
        },
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.jsonl").open("w") as sink:
        for row in rows:
            row["vs_runahead"] = rows[0]["tokens_per_s"] / row["tokens_per_s"]
            sink.write(json.dumps(row) + "\n")
            print(
                f"{row['system']:<60} {row['tokens_per_s']:7.2f} tok/s   runahead is {row['vs_runahead']:.2f}x"
            )


if __name__ == "__main__":
    main()
