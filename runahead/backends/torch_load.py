"""What :meth:`runahead.backends.torch.TorchBackend.open` loads and how its cache holds the experts:
the compute dtype resolved, the model read (a Hugging Face folder or a GGUF file), and the layout the
cache slots follow (the file's own form where the CPU kernel multiplies it, else the compute dtype)."""

from __future__ import annotations

from typing import Any

import torch

from runahead.backends.dtypes import resolve_dtype
from runahead.models.layout import ExpertLayout


def load_for_open(
    path: str, device: str, dtype: torch.dtype | str, expert_slots: str
) -> tuple[Any, ExpertLayout, torch.dtype]:
    """The model, its experts' layout and the compute dtype for :meth:`TorchBackend.open` (its
    ``dtype`` resolved: ``auto`` timed on CPU with the compute threads already set)."""
    from runahead.models import load_model
    from runahead.models.gguf import is_gguf
    from runahead.models.loader import checkpoint_layout, model_config

    on_cpu = torch.device(device).type == "cpu"
    in_file = None if is_gguf(path) else checkpoint_layout(path)  # headers only, read once here
    if dtype == "auto" and on_cpu and expert_slots != "compute" and stored_kernel_applies(path, in_file):
        compute = stored_compute_dtype(in_file) if expert_slots == "auto" else torch.float32
    elif dtype == "auto" and on_cpu:
        config = model_config(path)
        compute = resolve_dtype(dtype, device, (config.hidden_size, config.intermediate_size))
    else:
        compute = resolve_dtype(dtype, device)
    if in_file is None:  # a GGUF: experts kept as stored, dense matrices too where the kernel runs
        from runahead.models import qkernel

        kernel = on_cpu and compute == torch.float32 and qkernel.available()
        model, layout = load_model(path, device=device, dtype=compute, dense_as_stored=kernel)
        stored = stored_slots(layout, expert_slots, torch.device(device), compute)
    else:  # decided from the headers, so the resident matrices load as they will be kept
        stored = stored_slots(in_file, expert_slots, torch.device(device), compute)
        model, layout = load_model(path, device=device, dtype=compute, dense_as_stored=stored is not None)
    if stored is not None and not layout.stored:
        layout = stored  # the projections and LM head are kept as the file stores them too
        model.keep_stored(layout)
    return model, layout, compute


def stored_kernel_applies(path: str, layout: ExpertLayout | None = None) -> bool:
    """Whether float32 compute on this CPU would multiply ``path``'s experts as the file stores them
    (the kernel of :mod:`runahead.models.qkernel` runs here, and the file is a GGUF, or a safetensors
    checkpoint whose experts :func:`stored_slots` keeps as stored: all bf16 or all f16). ``layout``:
    the safetensors checkpoint's, where the caller has read its headers already.

    Where it would, ``auto`` computes in float32 (:func:`stored_compute_dtype`), unless a bfloat16
    checkpoint's experts multiply faster with bfloat16 rows on this CPU.
    """
    from runahead.models import qkernel
    from runahead.models.gguf import is_gguf
    from runahead.models.loader import checkpoint_layout

    if not qkernel.available():
        return False
    if is_gguf(path):
        return True
    layout = checkpoint_layout(path) if layout is None else layout
    return stored_slots(layout, "auto", torch.device("cpu"), torch.float32) is not None


def stored_compute_dtype(layout: ExpertLayout | None) -> torch.dtype:
    """``auto``'s compute dtype on the CPU for a checkpoint whose experts the kernel multiplies as stored
    (:func:`stored_kernel_applies`), given its safetensors layout (None for a GGUF): float32, except
    where its experts are all bfloat16 and bfloat16 rows multiply them faster on this CPU
    (:func:`runahead.backends.dtypes.faster_expert_rows`: measured once per process and shape).

    NOTE (why float32 first). The kernel runs a group's experts in two calls on their stored bytes,
    and float32 decodes token for token as transformers' float32 does. A GGUF's Q4_0 / Q8_0 and a
    float16 checkpoint's experts take float32 rows only. On an AVX-512 BF16 EPYC, before the kernel
    had bf16 dot products, a bfloat16 compute ran torch's products expert by expert and the medium
    model decoded one request 1.25x slower (9.7 against 12.1 tok/s; docs/results-torch.md, "Compute
    threads"); on an Intel Xeon with AMX the kernel's bf16 dot products made bfloat16 1.08x (one
    request) and 1.19x (eight) faster ("A bfloat16 checkpoint on an AMX Xeon"). A prompt's many rows
    per expert leave the kernel for dequantize-then-matmul, where bfloat16 is faster (a 512-token
    prompt took 1.5-1.9x as long in float32): for long prompts and short answers
    ``dtype="bfloat16"`` is the better choice.
    """
    from runahead.backends.dtypes import faster_expert_rows

    if layout is None:
        return torch.float32
    if {r.dtype for ranges in layout.ranges.values() for r in ranges} != {"BF16"}:
        return torch.float32
    return faster_expert_rows(layout.hidden_size, layout.intermediate_size)


def stored_slots(
    layout: ExpertLayout, mode: str, device: torch.device, dtype: torch.dtype
) -> ExpertLayout | None:
    """The layout the cache slots follow for ``expert_slots=mode``: ``layout`` itself, its stored form
    (:func:`runahead.models.layout.kept_as_stored`), or None to keep compute-dtype slots.

    ``auto`` keeps half-width experts as stored where the CPU kernel multiplies them: float32 compute on
    the CPU and the kernel built (``RUNAHEAD_QUANT_KERNEL`` not ``off``). ``stored`` raises where it
    cannot apply, naming why; ``compute`` refuses a GGUF (its experts have no other form here).
    """
    from runahead.models import qkernel
    from runahead.models.layout import EXPERT_SLOTS, HALF_WIDTH, kept_as_stored

    if mode not in EXPERT_SLOTS:
        choices = f"{', '.join(EXPERT_SLOTS[:-1])} or {EXPERT_SLOTS[-1]}"
        raise ValueError(f"expert_slots must be {choices}, not {mode!r}")
    if layout.stored:
        if mode == "compute":
            raise ValueError(
                "a GGUF's experts are kept as stored: expert_slots=compute applies to safetensors"
            )
        return layout
    if mode == "compute":
        return None
    why = None
    if device.type != "cpu" or dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        why = f"the compute is {name} on {device.type} (needs float32 on the CPU)"
    elif (stored := kept_as_stored(layout)) is None:
        found = sorted({r.dtype for ranges in layout.ranges.values() for r in ranges})
        why = f"the experts are {'/'.join(found)} (needs all {' or all '.join(HALF_WIDTH)}, no biases)"
    elif layout.hidden_size % qkernel.BLOCK or layout.intermediate_size % qkernel.BLOCK:
        why = (
            f"the kernel takes rows of whole {qkernel.BLOCK}-weight blocks, not the experts' "
            f"{layout.hidden_size} and {layout.intermediate_size}"
        )
    elif not qkernel.available():
        why = "the CPU kernel does not run here (RUNAHEAD_QUANT_KERNEL=off, or no C compiler)"
    if why is None:
        return stored
    if mode == "stored":
        raise ValueError(f"expert_slots=stored does not apply: {why}")
    return None
