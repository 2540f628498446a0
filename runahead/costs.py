"""Roofline cost model of layer jobs and expert fetches, from a ModelSpec and a HardwareProfile.

NOTE (the formula). One group is one backend call: jobs of several requests at one layer ``l``.
A job ``l -> l+1`` runs the MoE of layer ``l`` and then the attention and gate of layer ``l+1``
(the paper's job definition), so one group reads from memory:

* the ``distinct_experts`` routed experts of layer ``l`` once for the whole group, plus the
  layer's shared experts and dense MLP once;
* the attention, norm and router weights of layer ``l+1`` once;
* each job's own attention state of layer ``l+1``: ``context_length`` tokens of KV (a sliding
  window at most on local layers) or, on linear-attention layers, the recurrent state read and
  written back.

The entry job (``ENTRY_LAYER``, -1) reads embedding rows and attention 0 + gate 0, and no experts.
The job at the last layer runs MoE ``L-1`` and then the final norm + LM head (read once per group)
instead of a next attention. Then::

    time = group_overhead_s + jobs * job_overhead_s
           + max(bytes / (memory_bandwidth * bandwidth_efficiency), flops / peak_flops)
    flops = 2 * (active parameters each token goes through) * tokens  (+ attention scores)

A fetch moves one expert over the link: ``expert_bytes / link_bandwidth`` of link time after a
latency of ``link_latency_s`` (the sim backend overlaps up to ``link_queue_depth`` latencies).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from runahead.jobs import ENTRY_LAYER
from runahead.specs import HardwareProfile, ModelSpec


class CostModel:
    """Seconds of compute per group and of link time per fetch, for one model on one machine."""

    def __init__(self, model: ModelSpec, profile: HardwareProfile) -> None:
        self.model = model
        self.profile = profile
        bits = model.bits_per_weight / 8
        self._expert_bytes = model.expert_bytes
        self._ffn_shared_bytes = model.ffn_shared_params_per_layer * bits
        self._attention_bytes = model.attention_params_per_layer * bits
        self._lm_head_bytes = model.lm_head_params * bits
        self._embedding_row_bytes = model.hidden_size * bits
        self._bandwidth = profile.effective_memory_bandwidth

    # --- compute ----------------------------------------------------------------------------

    def compute_time(
        self,
        layer: int,
        num_tokens: Sequence[int],
        context_lengths: Sequence[int],
        distinct_experts: int,
        *,
        moe_only: bool = False,
        routed_fraction: float = 1.0,
    ) -> float:
        """Seconds for one group (one backend call) of jobs at ``layer``; called once per group computed.

        ``num_tokens[i]`` is job i's token count (1 in decode, the chunk size in prefill) and
        ``context_lengths[i]`` the tokens its attention reads (including its own). ``distinct_experts``
        counts the experts of ``layer`` the group's tokens go through; it is ignored for the entry job.
        Returns ``group_overhead_s + jobs * job_overhead_s + max(bytes / effective bandwidth,
        flops / peak_flops)``.
        """
        memory_bytes, flops = self.group_bytes_and_flops(
            layer,
            num_tokens,
            context_lengths,
            distinct_experts,
            moe_only=moe_only,
            routed_fraction=routed_fraction,
        )
        overhead = self.profile.group_overhead_s + len(num_tokens) * self.profile.job_overhead_s
        return overhead + max(memory_bytes / self._bandwidth, flops / self.profile.peak_flops)

    def group_bytes_and_flops(
        self,
        layer: int,
        num_tokens: Sequence[int],
        context_lengths: Sequence[int],
        distinct_experts: int,
        *,
        moe_only: bool = False,
        routed_fraction: float = 1.0,
    ) -> tuple[float, float]:
        """Bytes read from memory and flops of one group at ``layer`` (see the module NOTE for the terms).

        ``moe_only``: a non-final wave of a job whose experts did not fit in the cache at once
        (a prefill chunk): it reads only its own experts, for ``routed_fraction`` of the chunk's
        token-expert pairs; the final wave pays for the rest of the job.
        """
        model = self.model
        self._check(layer, num_tokens, context_lengths, distinct_experts)
        tokens = sum(num_tokens)
        if moe_only:
            flops = 2.0 * tokens * model.top_k * model.expert_params * routed_fraction
            return float(distinct_experts * self._expert_bytes), flops
        if layer == ENTRY_LAYER:
            memory_bytes = tokens * self._embedding_row_bytes
            flops = 0.0
        else:
            routed = distinct_experts * self._expert_bytes
            memory_bytes = routed + self._ffn_shared_bytes
            flops = (
                2.0
                * tokens
                * (model.top_k * model.expert_params * routed_fraction + model.ffn_shared_params_per_layer)
            )
        if layer == model.num_layers - 1:
            memory_bytes += self._lm_head_bytes
            flops += 2.0 * len(num_tokens) * model.lm_head_params  # only the sampled position needs logits
            return memory_bytes, flops
        next_layer = layer + 1
        memory_bytes += self._attention_bytes
        flops += 2.0 * tokens * model.attention_params_per_layer
        for n, context in zip(num_tokens, context_lengths, strict=True):
            memory_bytes += model.attention_state_bytes(next_layer, context)
            flops += n * self._attention_flops_per_token(next_layer, context)
        return memory_bytes, flops

    def step_compute_time(
        self,
        selections: Sequence[Sequence[Sequence[int]]],
        context_lengths: Sequence[int],
        grouping: Sequence[Sequence[int]] | None = None,
    ) -> float:
        """Compute time of one decode step (entry job + every layer) when requests run in fixed groups.

        ``selections[i][l]`` are request i's experts at layer l; ``grouping`` partitions the request
        indices into groups that each run as one backend call per layer (default: all together;
        ``[[0], [1], ...]`` runs every request separately). Used by calibration and static-grouping
        estimates; the runtime itself calls :meth:`compute_time` per group.
        """
        groups = grouping if grouping is not None else [list(range(len(selections)))]
        total = 0.0
        for members in groups:
            ones = [1] * len(members)
            contexts = [context_lengths[i] for i in members]
            total += self.compute_time(ENTRY_LAYER, ones, contexts, 0)
            for layer in range(self.model.num_layers):
                distinct = len({e for i in members for e in selections[i][layer]})
                total += self.compute_time(layer, ones, contexts, distinct)
        return total

    # --- fetch ------------------------------------------------------------------------------

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: what one fetch moves."""
        return self._expert_bytes

    @property
    def link_latency_s(self) -> float:
        """Seconds from issuing a read until its bytes start to move."""
        return self.profile.link_latency_s

    def fetch_transfer_time(self, expert_bytes: int | None = None) -> float:
        """Link busy seconds for ``expert_bytes`` (default one expert): ``bytes / link_bandwidth``."""
        size = self._expert_bytes if expert_bytes is None else expert_bytes
        if size < 0:
            raise ValueError(f"expert_bytes must be >= 0, got {size}")
        return size / self.profile.link_bandwidth

    # --- helpers ----------------------------------------------------------------------------

    def _attention_flops_per_token(self, layer: int, context: int) -> float:
        model = self.model
        if model.is_full_attention(layer) or model.sliding_window > 0:
            attended = context if model.is_full_attention(layer) else min(context, model.sliding_window)
            return 4.0 * attended * model.num_attention_heads * model.head_dim  # QK^T and AV
        return 4.0 * model.linear_state_bytes / 4  # f32 state: read-multiply-add per element, twice

    def _check(
        self, layer: int, num_tokens: Sequence[int], context_lengths: Sequence[int], distinct_experts: int
    ) -> None:
        model = self.model
        if not ENTRY_LAYER <= layer < model.num_layers:
            raise ValueError(f"layer {layer} out of range [{ENTRY_LAYER}, {model.num_layers - 1}]")
        if not num_tokens:
            raise ValueError("a group needs at least one job")
        if len(num_tokens) != len(context_lengths):
            raise ValueError(f"{len(num_tokens)} token counts but {len(context_lengths)} context lengths")
        if min(num_tokens) < 1 or min(context_lengths) < 0:
            raise ValueError("token counts must be >= 1 and context lengths >= 0")
        if layer != ENTRY_LAYER and not 0 <= distinct_experts <= model.num_experts:
            raise ValueError(f"distinct_experts {distinct_experts} out of range [0, {model.num_experts}]")
