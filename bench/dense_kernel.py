"""Resident matrices in the compute dtype: torch's product against the CPU kernel's pass, side by side.

``MoEModel.dense`` (and a group's routed experts) multiply a float32 matrix with the CPU kernel
(``qkernel.FLOAT32``) at up to ``qkernel.max_rows()`` rows, and, in a bfloat16 or float16 compute, a
matrix of that dtype with its half-width pass (``products.half_product``: rows widened, one rounding),
where they used to call ``F.linear``; this times both on the same matrices and rows in ``--dtype``,
one compute thread, cycling through ``--cold-mb`` of distinct matrices so the weights come from memory
as in a decode step (not from a cache that holds a single matrix). Shapes are ``N x K`` (outputs x
inputs): the small demo model's projections and experts (256 x 256, 64 x 256, 512 x 256), the medium
model's (1024 x 1024, 256 x 1024) and its LM head (32000 x 1024). Prints microseconds per call
(median of ``--repeat`` calls) and the kernel's time over torch's.

    PYTHONPATH=$PWD python bench/dense_kernel.py [--dtype float32] [--rows 1,2,4,8,16,32] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from runahead.models import qkernel
from runahead.models.products import half_product

SHAPES = ((256, 256), (64, 256), (512, 256), (1024, 1024), (256, 1024), (32000, 1024))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def median_us(call: Callable[[], object], repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def time_point(matrices: list[torch.Tensor], rows: int, repeat: int) -> tuple[float, float]:
    """Microseconds per call, torch's and the kernel's, of ``rows`` rows through ``matrices`` in turn."""
    n, k = matrices[0].shape
    dtype = matrices[0].dtype
    x = torch.randn(rows, k).to(dtype)
    turn = itertools.cycle(matrices)
    torch_us = median_us(lambda: F.linear(x, next(turn)), repeat)

    def kernel(w: torch.Tensor) -> torch.Tensor:
        if dtype == torch.float32:
            return qkernel.product(x, w.data_ptr(), qkernel.FLOAT32, n)
        return half_product(x, w.data_ptr(), qkernel.HALF_KINDS[dtype], n)

    turn = itertools.cycle(matrices)
    kernel_us = median_us(lambda: kernel(next(turn)), repeat)
    reference = F.linear(x.float(), matrices[0].float())  # the exact products, summed in float32
    scale = reference.abs().max().item()
    for name, ours in (("torch", F.linear(x, matrices[0])), ("kernel", kernel(matrices[0]))):
        gap = (ours.float() - reference).abs().max().item()
        allowed = 1e-3 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * scale
        assert gap <= allowed, f"{name} is off at {n}x{k}, {rows} rows in {dtype}: {gap} > {allowed}"
    return torch_us, kernel_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="rows' and matrices' dtype")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--cold-mb", type=int, default=128, help="distinct matrices cycled through per shape")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not qkernel.multiplies(qkernel.FLOAT32, (256,)):
        raise SystemExit("the CPU kernel does not run here (no compiler, or RUNAHEAD_QUANT_KERNEL=off)")
    torch.set_num_threads(1)
    results = []
    print(f"{'shape':>12} {'rows':>4} {'torch us':>9} {'kernel us':>9} {'kernel / torch':>14}")
    with torch.inference_mode():
        for n, k in SHAPES:
            dtype = DTYPES[args.dtype]
            count = max(2, (args.cold_mb << 20) // (dtype.itemsize * n * k))
            matrices = [torch.randn(n, k).to(dtype) for _ in range(count)]
            repeat = max(5, args.repeat * (1 << 20) // (n * k)) if n * k > 1 << 20 else args.repeat
            for rows in (int(r) for r in args.rows.split(",")):
                torch_us, kernel_us = time_point(matrices, rows, repeat)
                results.append(
                    {
                        "dtype": args.dtype,
                        "n": n,
                        "k": k,
                        "rows": rows,
                        "torch_us": torch_us,
                        "kernel_us": kernel_us,
                    }
                )
                ratio = kernel_us / torch_us
                print(f"{n:>6}x{k:<5} {rows:>4} {torch_us:>9.1f} {kernel_us:>9.1f} {ratio:>14.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(json.dumps(r) for r in results) + "\n")


if __name__ == "__main__":
    main()
