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

import sys
from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from operator import add

from runahead.jobs import ENTRY_LAYER, Job
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
        self._routed_params = model.top_k * model.expert_params
        self._ffn_shared_params = model.ffn_shared_params_per_layer
        self._attention_params = model.attention_params_per_layer
        self._lm_head_params = model.lm_head_params
        self._last_layer = model.num_layers - 1
        # a job's attention at each layer: over at most ``window`` tokens (the whole context: the
        # largest int), or None: a linear-attention state, the same terms at any context
        self._windows = [
            sys.maxsize if model.is_full_attention(layer) else model.sliding_window or None
            for layer in range(model.num_layers)
        ]
        self._kv_bytes = model.kv_bytes_per_token
        self._heads, self._head_dim = model.num_attention_heads, model.head_dim
        linear = model.linear_state_bytes  # f32 state: read-multiply-add per element, twice
        self._linear_terms = 2 * linear, 4.0 * linear / 4

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
        return self._seconds(len(num_tokens), memory_bytes, flops)

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
        self._check(layer, num_tokens, context_lengths, distinct_experts)
        tokens = sum(num_tokens)
        if moe_only:
            model = self.model
            flops = 2.0 * tokens * model.top_k * model.expert_params * routed_fraction
            return float(distinct_experts * self._expert_bytes), flops
        memory_bytes, flops = self._group_terms(
            layer, len(num_tokens), tokens, distinct_experts, routed_fraction
        )
        if layer == self._last_layer:
            return memory_bytes, flops
        next_layer = layer + 1
        for n, context in zip(num_tokens, context_lengths, strict=True):
            state_bytes, flops_per_token = self._job_terms(next_layer, context)
            memory_bytes += state_bytes
            flops += n * flops_per_token
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

    def _group_terms(
        self, layer: int, jobs: int, tokens: int, distinct_experts: int, routed_fraction: float
    ) -> tuple[float, float]:
        """Bytes and flops of a group of ``jobs`` jobs (``tokens`` tokens) at ``layer`` but for
        each job's own attention state (:meth:`_job_terms`, added job after job by the caller)."""
        if layer == ENTRY_LAYER:
            memory_bytes = tokens * self._embedding_row_bytes
            flops = 0.0
        else:
            memory_bytes = distinct_experts * self._expert_bytes + self._ffn_shared_bytes
            flops = 2.0 * tokens * (self._routed_params * routed_fraction + self._ffn_shared_params)
        if layer == self._last_layer:
            memory_bytes += self._lm_head_bytes
            flops += 2.0 * jobs * self._lm_head_params  # only the sampled position needs logits
        else:
            memory_bytes += self._attention_bytes
            flops += 2.0 * tokens * self._attention_params
        return memory_bytes, flops

    def _job_terms(self, layer: int, context: int) -> tuple[int, float]:
        """One job's attention state at ``layer`` over ``context`` tokens: its bytes
        (:meth:`ModelSpec.attention_state_bytes`: KV read, or a linear-attention state read and
        written back) and its flops per token (QK^T and AV over the tokens it attends)."""
        window = self._windows[layer]
        if window is None:
            return self._linear_terms
        attended = min(context, window)
        return attended * self._kv_bytes, 4.0 * attended * self._heads * self._head_dim

    def _seconds(self, jobs: int, memory_bytes: float, flops: float) -> float:
        """A group's seconds from its bytes and flops: overheads plus the roofline's bound."""
        overhead = self.profile.group_overhead_s + jobs * self.profile.job_overhead_s
        return overhead + max(memory_bytes / self._bandwidth, flops / self.profile.peak_flops)

    def _check(
        self, layer: int, num_tokens: Sequence[int], context_lengths: Sequence[int], distinct_experts: int
    ) -> None:
        self._check_layer(layer)
        if not num_tokens:
            raise ValueError("a group needs at least one job")
        if len(num_tokens) != len(context_lengths):
            raise ValueError(f"{len(num_tokens)} token counts but {len(context_lengths)} context lengths")
        _check_job(min(num_tokens), min(context_lengths))
        self._check_distinct(layer, distinct_experts)

    def _check_layer(self, layer: int) -> None:
        if not ENTRY_LAYER <= layer <= self._last_layer:
            raise ValueError(f"layer {layer} out of range [{ENTRY_LAYER}, {self._last_layer}]")

    def _check_distinct(self, layer: int, distinct_experts: int) -> None:
        experts = self.model.num_experts
        if layer != ENTRY_LAYER and not 0 <= distinct_experts <= experts:
            raise ValueError(f"distinct_experts {distinct_experts} out of range [0, {experts}]")


def _check_job(num_tokens: int, context_length: int) -> None:
    if num_tokens < 1 or context_length < 0:
        raise ValueError("token counts must be >= 1 and context lengths >= 0")


class GroupCost:
    """One group's compute seconds as it grows by one job at a time (bottleneck grouping's candidate
    groups: a :class:`runahead.bottleneck.RunningGroup`).

    After any sequence of :meth:`add`, :meth:`seconds` equals :meth:`CostModel.compute_time` of those
    jobs in that order (whole jobs: ``routed_fraction`` 1) at the first job's layer, with
    ``context(job)`` the tokens each job's attention reads, bit for bit: the running counts are
    integers, and each job's attention terms are kept as computed and summed in the same order onto
    the same group terms. An ``add`` prices only its own job; :meth:`seconds` sums in C.
    """

    __slots__ = ("_context", "_costs", "_flops", "_state_bytes", "experts", "jobs", "layer", "tokens")

    def __init__(self, costs: CostModel, context: Callable[[Job], int], jobs: Iterable[Job] = ()) -> None:
        self._costs, self._context = costs, context
        self.layer: int | None = None  # the first job's
        self.jobs = 0
        self.tokens = 0
        self.experts: set[int] = set()
        self._state_bytes: list[int] = []  # each job's attention-state bytes, in order
        self._flops: list[float] = []  # each job's attention flops, in order
        for job in jobs:
            self.add(job)

    def add(self, job: Job) -> None:
        costs, layer = self._costs, self.layer
        if layer is None:
            costs._check_layer(job.layer)
            layer = self.layer = job.layer
        num_tokens, context = job.num_tokens, self._context(job)
        if num_tokens < 1 or context < 0:
            _check_job(num_tokens, context)  # raises
        self.jobs += 1
        self.tokens += num_tokens
        self.experts.update(job.experts)
        if layer != costs._last_layer:
            state_bytes, flops_per_token = costs._job_terms(layer + 1, context)
            self._state_bytes.append(state_bytes)
            self._flops.append(num_tokens * flops_per_token)

    def seconds(self) -> float:
        """Compute seconds of the jobs added so far, as one group."""
        costs, layer = self._costs, self.layer
        if layer is None:
            raise ValueError("a group needs at least one job")
        distinct = len(self.experts)
        if distinct > costs.model.num_experts:
            costs._check_distinct(layer, distinct)  # raises, but at the entry layer (no experts)
        memory_bytes, flops = costs._group_terms(layer, self.jobs, self.tokens, distinct, 1.0)
        memory_bytes = reduce(add, self._state_bytes, memory_bytes)
        flops = reduce(add, self._flops, flops)
        return costs._seconds(self.jobs, memory_bytes, flops)
