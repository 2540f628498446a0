"""Ways to run one Q4_0 / Q8_0 expert on the torch CPU backend, timed side by side in one run.

The medium model's expert shapes (hidden 1024, expert width 512: ``gate | up [512, 1024]``,
``down [1024, 512]``), 1 to 8 rows, float32 activations. Each option computes the same expert
``down(silu(gate x) * up x)`` from a slot of the file's bytes; the script checks each against the
float32 reference on the dequantized weights (max abs difference) and times it (median and fastest
of ``--repeat``, rotating over ``--experts`` distinct slots so the quantized bytes are not all hot in cache):

- ``f32-resident``: matmuls only on float32 weights already in memory (what a slot of dequantized
  weights, or a reuse cache hit, costs; the lower bound for any dequantizer)
- ``dequant-<name>``: a dequantizer into one reused float32 scratch, then the matmuls: ``previous``
  (the project's before this bench), ``current`` (``runahead.models.quant`` now), ``signed`` (the
  whole slot at once, one fused int8 * float32 product per half), ``lut`` (a byte -> two weights table)
- ``int4pack``: torch's CPU int4 weight-only kernel on weights packed once (the pack time is
  reported apart: it would run at slot install time)
- ``compiled``: the fast dequantizer under ``torch.compile`` (with ``--compile``; its compile time
  is reported)
- ``qkernel``: the products on the stored bytes (``runahead.models.qkernel``), no dequantized copy;
  ``qkernel-portable``: the same with the kernel's portable C build (what arm64 CPUs run);
  ``qkernel-against``: the same with the build of another ``qkernel.c`` (``--against FILE``, e.g. an
  earlier commit's: ``git show ce0c81e~1:runahead/models/qkernel.c > /tmp/before.c``)

``--kinds`` takes ``Q4_0``, ``Q8_0`` and ``BF16`` (a bf16 checkpoint's experts as stored; only the current
dequantizer applies to it).

    PYTHONPATH=$PWD python bench/quant_kernels.py [--rows 1,2,4,8] [--repeat 30] [--against FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from torch import Tensor

from runahead.models import qkernel
from runahead.models.layout import SlotFormat, SlotPart, stored_nbytes
from runahead.models.quant import dequantize_slot

HIDDEN, INTER = 1024, 512


def make_slot(kind: str, rng: np.random.Generator) -> tuple[Tensor, SlotFormat]:
    """One expert's ``gate | up | down`` as ``kind`` bytes (the gguf package's quantizer), and its format."""
    parts, chunks, at = [], [], 0
    for role, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
        weights = rng.standard_normal(shape, dtype=np.float32) * 0.05
        data = quants.quantize(weights, GGMLQuantizationType[kind]).reshape(-1)
        size = stored_nbytes(kind, shape)
        assert data.nbytes == size
        parts.append(SlotPart(role, kind, shape, at, at + size))
        chunks.append(data)
        at += size
    return torch.from_numpy(np.concatenate(chunks)), SlotFormat(tuple(parts))


def run_expert(w: Tensor, x: Tensor) -> Tensor:
    """The model's expert on the flat float32 ``gate | up | down`` ``w`` (as ``MoEModel.run_expert``)."""
    block = INTER * HIDDEN
    gate_up = F.linear(x, w[: 2 * block].view(2 * INTER, HIDDEN))
    return F.linear(F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], w[2 * block :].view(HIDDEN, INTER))


def dequant_current(slot: Tensor, fmt: SlotFormat, out: Tensor) -> Tensor:
    """The dequantizer of the current code path (``runahead.models.quant``), part by part."""
    return dequantize_slot(slot, fmt, torch.float32, out)


def dequant_previous(slot: Tensor, fmt: SlotFormat, out: Tensor) -> Tensor:
    """The dequantizer before this bench (``quant.py`` at commit 2e67dc1), part by part: nibbles
    copied into float32, then ``- 8`` and ``* d`` as two more passes (Q8_0: copy, then ``* d``)."""
    at = 0
    for part in fmt.parts:
        n = part.shape[0] * part.shape[1]
        data, weights = slot[part.start : part.stop], out[at : at + n]
        if part.kind == "Q8_0":
            blocks = data.view(-1, 34)
            scale = blocks[:, :2].contiguous().view(torch.float16).float()
            weights.view(-1, 32).copy_(blocks[:, 2:].contiguous().view(torch.int8))
            weights.view(-1, 32).mul_(scale)
        else:
            blocks = data.view(-1, 18)
            scale = blocks[:, :2].contiguous().view(torch.float16).float()
            halves = weights.view(-1, 2, 16)
            halves[:, 0].copy_(blocks[:, 2:] & 0x0F)
            halves[:, 1].copy_(blocks[:, 2:] >> 4)
            halves.sub_(8).mul_(scale.unsqueeze(-1))
        at += n
    return out[:at]


def dequant_signed(slot: Tensor, fmt: SlotFormat, out: Tensor) -> Tensor:
    """The whole slot in one set of ops (every part shares a type): nibbles sign-extended in int8
    (``q - 8 == sext4(q ^ 8)``), then one fused int8 * float32 product per half straight into ``out``."""
    kind = fmt.parts[0].kind
    n = sum(p.shape[0] * p.shape[1] for p in fmt.parts)
    if kind == "Q8_0":
        blocks = slot[: fmt.nbytes].view(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        torch.mul(blocks[:, 2:].view(torch.int8), scale, out=out[:n].view(-1, 32))
        return out[:n]
    blocks = slot[: fmt.nbytes].view(-1, 18)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:] ^ 0x88
    halves = out[:n].view(-1, 2, 16)
    torch.mul((q << 4).view(torch.int8) >> 4, scale, out=halves[:, 0])
    torch.mul(q.view(torch.int8) >> 4, scale, out=halves[:, 1])
    return out[:n]


def dequant_lut(slot: Tensor, fmt: SlotFormat, out: Tensor) -> Tensor:
    """Q4_0 through a 256-entry table: each byte to its two weights ``(lo - 8, hi - 8)`` (gathered
    as int32 indices), then one product with the scale; the halves land interleaved, so the input
    rows' columns would have to be permuted to match (timed as if they were)."""
    blocks = slot[: fmt.nbytes].view(-1, 18)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    pairs = F.embedding(blocks[:, 2:].int(), LUT)  # [nb, 16, 2]
    n = sum(p.shape[0] * p.shape[1] for p in fmt.parts)
    torch.mul(pairs, scale.unsqueeze(-1), out=out[:n].view(-1, 16, 2))
    return out[:n]


_byte = torch.arange(256)
LUT = torch.stack(((_byte & 15) - 8, (_byte >> 4) - 8), dim=1).float()

DEQUANTIZERS: dict[str, Callable[[Tensor, SlotFormat, Tensor], Tensor]] = {
    "previous": dequant_previous,
    "current": dequant_current,
    "signed": dequant_signed,
    "lut": dequant_lut,
}


def pack_int4(slot: Tensor, fmt: SlotFormat) -> list[tuple[Tensor, Tensor]]:
    """Each part as torch's CPU int4 layout: ``(packed [N, K/2], scales_and_zeros [K/32, N, 2])``,
    scale ``d`` and zero 0 (torch's int4 weight is ``(q - 8) * scale + zero``, Q4_0's ``(q - 8) * d``)."""
    packed = []
    for part in fmt.parts:
        n, k = part.shape
        blocks = slot[part.start : part.stop].view(n, k // 32, 18)
        scale = blocks[..., :2].contiguous().view(torch.float16).float().view(n, k // 32)
        nib = blocks[..., 2:]
        q = torch.cat(((nib & 15), (nib >> 4)), dim=-1).reshape(n, k).int()
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack((scale.t(), torch.zeros_like(scale.t())), dim=-1).contiguous()
        packed.append((w, sz))
    return packed


def run_int4(packed: list[tuple[Tensor, Tensor]], x: Tensor) -> Tensor:
    (g, gs), (u, us), (d, ds) = packed
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    h = F.silu(mm(x, g, 32, gs)) * mm(x, u, 32, us)
    return mm(h.contiguous(), d, 32, ds)  # type: ignore[no-any-return]


def run_qkernel(
    slot: Tensor, fmt: SlotFormat, x: Tensor, build: str | tuple[str, Path] | None = None
) -> Tensor:
    """The expert on the stored bytes (``runahead.models.qkernel``) as ``MoEModel.stored_experts`` runs it."""
    kind, span, base = fmt.parts[0].kind, [(0, x.shape[0])], slot.data_ptr()
    gate_up = qkernel.grouped_product(x, [base], span, kind, 2 * INTER, build=build)
    h = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    return qkernel.grouped_product(h, [base + fmt.parts[2].start], span, kind, HIDDEN, build=build)


def timed_ms(fn: Callable[[int], Any], repeat: int) -> tuple[float, float]:
    """``(median, fastest)`` milliseconds of ``repeat`` calls (after one warm-up): on a machine shared
    with other work the fastest is the closest to the uncontended cost, the median what a run sees."""
    fn(0)
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def measure(
    kind: str, rows: list[int], repeat: int, experts: int, compile_too: bool, against: Path | None = None
) -> list[dict[str, Any]]:
    """One table row per row count (each option's median ms and max difference), then one of extras."""
    rng = np.random.default_rng(0)
    made = [make_slot(kind, rng) for _ in range(experts)]
    slots, fmt = [s for s, _ in made], made[0][1]
    numel = 3 * HIDDEN * INTER
    scratch = torch.empty(numel)
    reference = [dequant_current(s, fmt, torch.empty(numel)).clone() for s in slots]
    inputs = {r: torch.randn(r, HIDDEN) for r in rows}
    expected = {r: run_expert(reference[0], x) for r, x in inputs.items()}
    quantized = kind in ("Q4_0", "Q8_0")
    dequantizers = {
        n: dq
        for n, dq in DEQUANTIZERS.items()
        if n == "current" or (quantized and (n != "lut" or kind == "Q4_0"))
    }
    options: dict[str, Callable[[int, Tensor], Tensor]] = {
        "f32-resident": lambda i, x: run_expert(reference[i % experts], x)
    }
    for name, dq in dequantizers.items():
        options[f"dequant-{name}"] = lambda i, x, dq=dq: run_expert(dq(slots[i % experts], fmt, scratch), x)
    if qkernel.available():
        options["qkernel"] = lambda i, x: run_qkernel(slots[i % experts], fmt, x)
    if qkernel.load("portable") is not None:
        options["qkernel-portable"] = lambda i, x: run_qkernel(slots[i % experts], fmt, x, "portable")
    other = (qkernel.variant() or "portable", against) if against is not None else None
    if other is not None and qkernel.load(*other) is not None:
        options["qkernel-against"] = lambda i, x: run_qkernel(slots[i % experts], fmt, x, other)
    extra: dict[str, Any] = {"kind": kind, "threads": torch.get_num_threads()}
    if kind == "Q4_0":
        start = time.perf_counter()
        packed = [pack_int4(s, fmt) for s in slots]
        extra["int4pack_pack_ms_per_expert"] = 1e3 * (time.perf_counter() - start) / experts
        options["int4pack"] = lambda i, x: run_int4(packed[i % experts], x)
    if compile_too:
        start = time.perf_counter()
        compiled = torch.compile(dequant_signed, dynamic=False)
        compiled(slots[0], fmt, scratch)
        extra["compile_s"] = time.perf_counter() - start
        options["compiled"] = lambda i, x: run_expert(compiled(slots[i % experts], fmt, scratch), x)
    for name, dq in dequantizers.items():
        only = timed_ms(lambda i, dq=dq: dq(slots[i % experts], fmt, scratch), repeat)
        extra[f"dequant_only_ms_{name}"], extra[f"dequant_only_min_ms_{name}"] = only
        if name != "lut":
            extra[f"dequant_exact_{name}"] = torch.equal(dq(slots[0], fmt, scratch), reference[0])
    table = []
    perm = torch.arange(HIDDEN).view(-1, 2, 16).transpose(1, 2).reshape(-1)  # the table's interleaved order
    for r in rows:
        row: dict[str, Any] = {"kind": kind, "rows": r}
        for name, fn in options.items():
            x = inputs[r][:, perm].contiguous() if name == "dequant-lut" else inputs[r]
            median, fastest = timed_ms(lambda i, x=x, fn=fn: fn(i, x), repeat)
            row[name + "_ms"], row[name + "_min_ms"] = round(median, 3), round(fastest, 3)
            if name != "dequant-lut":  # its columns are permuted: timed only
                row[name + "_maxdiff"] = float((fn(0, x) - expected[r]).abs().max())
        table.append(row)
        print(json.dumps(row))
    print(json.dumps(extra))
    return [*table, extra]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--experts", type=int, default=48, help="distinct slots to rotate over")
    parser.add_argument("--kinds", default="Q4_0,Q8_0")
    parser.add_argument("--threads", type=int, help="torch's (and the kernel's) threads; default torch's")
    parser.add_argument(
        "--compile", action="store_true", help="also time the dequantizer under torch.compile"
    )
    parser.add_argument("--against", type=Path, help="another qkernel.c to time beside this one")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    rows = [int(r) for r in args.rows.split(",")]
    results = [
        r
        for kind in args.kinds.split(",")
        for r in measure(kind, rows, args.repeat, args.experts, args.compile, args.against)
    ]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
