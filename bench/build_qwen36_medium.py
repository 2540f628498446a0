"""Build a medium random Qwen3.6-shaped model (~3 GB of bf16 experts) for the torch benchmark.

The layout of Qwen3.6-35B-A3B at a size this CPU can run: 16 layers, 3 of every 4 Gated DeltaNet
linear attention (per-request recurrent state) and 1 gated full attention, 64 experts top-8 of width
512 plus a sigmoid-gated shared expert of 512, hidden 1024. Routers are scaled up and the init widened
so routing varies, as for the ``medium`` Qwen3-MoE. Saved in the hub's per-expert format with a
trained tokenizer. Usage: ``python bench/build_qwen36_medium.py OUT_FOLDER``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from runahead.tokenizer import save_tokenizer

CONFIG = {
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "full_attention_interval": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROUTER_SCALE = 8.0


def main(out: Path) -> None:
    if (out / "config.json").exists():
        print(f"{out} exists")
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3_5_moe_text", **CONFIG), dtype=torch.bfloat16
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SCALE)
    partial = out.with_name(out.name + ".partial")
    save_tokenizer(partial, CONFIG["vocab_size"])
    model.save_pretrained(partial)
    partial.rename(out)
    print(f"built {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
