"""Single-request decode speed with every expert resident: runahead's torch backend vs transformers.

Same model (default: the medium one), same device, same dtype (default float32), greedy, one
request; both warmed up first. Writes OUT/results.jsonl with tokens/s of each and their ratio.
On CPU it also times transformers in bfloat16.

    python bench/single_request.py --out DIR [--model PATH] [--device cuda] [--dtype bfloat16]
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


def transformers_tokens_per_s(path: str, dtype: torch.dtype, device: str = "cpu") -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    prompt = torch.tensor([[11]], device=device)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return STEPS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", help="a model folder (default: the medium model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    path = args.model or str(medium_model())
    ours = run_torch_point(
        TorchPoint(
            path,
            "runahead",
            1,
            1.0,
            STEPS,
            store="host",
            device=args.device,
            warmup_steps=4,
            preload=True,
            dtype=args.dtype,
        )
    )
    where = f"{args.dtype} on {args.device}"
    rows = [
        {
            "system": f"runahead torch backend ({where}, all experts resident)",
            "tokens_per_s": ours["tokens_per_s"],
        },
        {
            "system": f"transformers generate ({where})",
            "tokens_per_s": transformers_tokens_per_s(path, getattr(torch, args.dtype), args.device),
        },
    ]
    if args.device == "cpu" and args.dtype == "float32":
        rows.append(
            {
                "system": "transformers generate (bfloat16 on cpu)",
                "tokens_per_s": transformers_tokens_per_s(path, torch.bfloat16),
            }
        )
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
