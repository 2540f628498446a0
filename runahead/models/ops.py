"""The layers' arithmetic without state, as transformers computes it: RMSNorm, the rotary embedding's
tables and rotation, the attention mask. :class:`runahead.models.base.MoEModel` and the
architectures call these; nothing here knows a model, a request or a cache slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers computes it (in float32, scaled after casting back).

    On an accelerator the normalising is torch's one ``F.rms_norm`` call (a fused kernel on CUDA)
    instead of five: there each call is host time and a launch (docs/cuda-runs.md). On CPU the five
    calls stay: ``F.rms_norm`` gives the same bits there but measured slower (docs/tried.md)."""
    wide = x.dtype == torch.float32  # then no casts: each is a no-op op call (7 norms a layer)
    x32 = x if wide else x.float()
    if x.device.type == "cpu":
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    else:
        x32 = fused_rms_norm(x32, eps)
    return weight * (x32 if wide else x32.to(x.dtype))


def fused_rms_norm(x32: Tensor, eps: float) -> Tensor:
    """``x32 * rsqrt(mean(x32^2) + eps)`` over the last dimension of a float32 ``x32``, as one call."""
    return F.rms_norm(x32, (x32.shape[-1],), None, eps)


def rope_tables(
    positions: Tensor, inv_freq: Tensor, factor: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin ``[T, 1, 2 * len(inv_freq)]`` of the rotary embedding at ``positions``, in ``dtype``,
    the sin with its first half negated (:func:`apply_rope` rolls ``x`` instead of rotating its
    halves: ``rotate_half(x) * sin`` is ``roll(x) * signed sin`` to the bit, one call instead of four).

    ``factor`` scales cos and sin (YaRN's attention factor; 1 otherwise).
    """
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * factor
    half = freqs.shape[-1]
    sin[:, :half] = -sin[:, :half]
    return (emb.cos() * factor).to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x [T, heads, head_dim]`` by :func:`rope_tables`' ``cos`` and signed
    ``sin``: ``x * cos + rotate_half(x) * sin`` as transformers writes it; only their first dims
    rotate (a partial rotary keeps the rest as is)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + x.roll(rotary // 2, dims=-1) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + turned.roll(rotary // 2, dims=-1) * sin, kept), dim=-1)


def attention_mask(
    start: int, n: int, first: int, stored: int, window: int | None, device: torch.device
) -> Tensor | None:
    """Boolean ``[n, stored]`` mask (True = attend) for queries at ``start..`` over keys at ``first..``."""
    if n == 1 and (window is None or start - first < window):
        return None
    q_pos = torch.arange(start, start + n, device=device)[:, None]
    k_pos = torch.arange(first, first + stored, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed
