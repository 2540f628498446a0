"""Per-request state: what a request carries from token to token, layer by layer.

One :class:`RequestState` per request, created at admission (the backend's ``open_request`` calls
:meth:`runahead.models.base.MoEModel.new_cache`), advanced by every prefill chunk and decode step,
and dropped at completion or cancellation (``close_request``): nothing else holds it, so its memory
goes with it. Each layer has its own state, chosen by the architecture for that layer's token mixer:

- :class:`KVLayer`: the keys and values of softmax attention, growing by doubling. With a sliding
  window it keeps only the keys a later query can still see, so its memory stays bounded.
- :class:`RecurrentLayer`: a linear-attention layer's fixed-size state (Gated DeltaNet): the last
  ``kernel - 1`` inputs of its causal convolution and the ``[heads, key_dim, value_dim]`` matrix
  of its recurrence.

Layers fill at different times (a request part-way through a token has entered it into layers
``0..l`` only), so each layer counts its own tokens. A group batches several requests' rows, but
each request's rows only ever read and write its own state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class KVLayer:
    """One layer's keys and values ``[1, kv_heads, stored, head_dim]`` (a sliding window keeps the
    tail). The leading dimension of one is the batch torch's attention reads: stored so, no call
    adds it per request and group."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 64,
        window: int | None = None,
        value_dim: int | None = None,
    ) -> None:
        shape = (1, num_kv_heads, capacity)
        self.keys = torch.empty((*shape, head_dim), dtype=dtype, device=device)
        self.values = torch.empty((*shape, value_dim or head_dim), dtype=dtype, device=device)
        self.window = window
        self.length = 0  # tokens entered (positions 0..length-1)
        self.first = 0  # position of the first key still stored
        self.stored = 0

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, int]:
        """Append ``[1, kv_heads, n, dim]`` keys / values; return the stored keys, values, first position.

        With a window, keys that no query from this chunk on can attend to (position
        ``<= start - window``) are dropped when the store would otherwise grow, so it stays near
        ``window + chunk`` long; callers mask by position, so keys kept a little longer are harmless.
        """
        start, n = self.length, keys.shape[2]
        if self.stored + n > self.keys.shape[2] and self.window is not None:
            drop = min(max(0, start - self.window + 1 - self.first), self.stored)
            if drop:
                kept = self.stored - drop
                self.keys[:, :, :kept] = self.keys[:, :, drop : self.stored].clone()
                self.values[:, :, :kept] = self.values[:, :, drop : self.stored].clone()
                self.first += drop
                self.stored = kept
        if self.stored + n > self.keys.shape[2]:
            self._grow(self.stored + n)
        self.keys[:, :, self.stored : self.stored + n] = keys
        self.values[:, :, self.stored : self.stored + n] = values
        self.stored += n
        self.length = start + n
        return self.keys[:, :, : self.stored], self.values[:, :, : self.stored], self.first

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[2])
        keys = self.keys.new_empty((1, self.keys.shape[1], capacity, self.keys.shape[3]))
        values = self.values.new_empty((1, self.values.shape[1], capacity, self.values.shape[3]))
        keys[:, :, : self.stored] = self.keys[:, :, : self.stored]
        values[:, :, : self.stored] = self.values[:, :, : self.stored]
        self.keys, self.values = keys, values


class RecurrentLayer:
    """A linear-attention layer's state: the convolution's last inputs and the recurrence ``[H, K, V]``."""

    def __init__(
        self,
        channels: int,
        kernel: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.conv = torch.zeros((channels, kernel - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((heads, key_dim, value_dim), dtype=torch.float32, device=device)
        self.length = 0


LayerState = KVLayer | RecurrentLayer


class RequestState:
    """Every layer's state of one request (see the module docstring)."""

    def __init__(self, layers: Sequence[LayerState]) -> None:
        self.layers = list(layers)

    @property
    def length(self) -> int:
        """Tokens the request has entered (in layer 0): the position of its next token."""
        return self.layers[0].length

    @property
    def lengths(self) -> list[int]:
        """Tokens entered into each layer."""
        return [layer.length for layer in self.layers]

    def kv(self, layer: int) -> KVLayer:
        """Layer ``layer``'s KV state; ``TypeError`` if that layer is not softmax attention."""
        state = self.layers[layer]
        if not isinstance(state, KVLayer):
            raise TypeError(f"layer {layer} keeps a {type(state).__name__}, not keys and values")
        return state

    def recurrent(self, layer: int) -> RecurrentLayer:
        """Layer ``layer``'s recurrent state; ``TypeError`` if that layer is not linear attention."""
        state = self.layers[layer]
        if not isinstance(state, RecurrentLayer):
            raise TypeError(f"layer {layer} keeps a {type(state).__name__}, not a recurrent state")
        return state

    def nbytes(self) -> int:
        """Bytes of tensors this state holds now (KV capacity included)."""
        total = 0
        for state in self.layers:
            tensors = (
                (state.keys, state.values) if isinstance(state, KVLayer) else (state.conv, state.recurrent)
            )
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total
