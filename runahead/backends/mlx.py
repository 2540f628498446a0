"""The ``mlx`` backend: real MoE models on MLX (Metal on Apple silicon, MLX's CPU build elsewhere).

A peer of the torch backend (:mod:`runahead.backends.torch`) behind the same protocol, actors and
policies. Non-expert weights stay resident in the model (:mod:`runahead.models.mlx.base`); routed
experts live in a fixed pool of slots per expert tensor (:mod:`runahead.models.mlx.slots`) and reach
it only through :meth:`MLXBackend.fetch`: the store's worker threads read an expert's byte ranges
(``O_DIRECT`` on Linux) into host buffers, which the next compute writes into the slot in place.

``compute(group)`` runs one job for every request of the group as one batch on a dedicated compute
thread (the event loop never waits for MLX): the MoE of the layer as one gathered (quantized) matmul
per expert matrix over slot indices, then the next layer's attention (each request over its own
keys and values) and gate. MLX is lazy: the group's outputs (hidden rows, routing, sampled tokens,
keys and values) are evaluated with ``mx.eval`` before the call returns, so the runtime releases the
group's pins only after every read of their slots has happened.

Prompts go through the same jobs in chunks; a chunk whose experts do not fit the cache at once runs
its MoE in waves (the runtime's): this backend keeps each routed pair's weighted product from its
wave and sums them at the last wave in the order one wave adds them, so which experts the cache put
in which wave never reaches the result's last bits (:mod:`runahead.backends.waves` says why; the
torch backend's twin of this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from runahead.backend import READS_IN_FLIGHT
from runahead.backends.common import (
    RequestLifecycle,
    SlotOwners,
    distinct_experts,
    input_tokens,
    row_spans,
)
from runahead.backends.priority import wanted_nice
from runahead.jobs import ENTRY_LAYER, ExpertKey, Group, Job, JobResult, RequestSpec
from runahead.models.mlx import mlx_architecture
from runahead.models.mlx.base import MLXModel, RequestStateMLX, moe_sum
from runahead.models.mlx.checkpoint import Checkpoint, load_checkpoint
from runahead.models.mlx.slots import ExpertReader, SlotPools
from runahead.sampling import Sampler, TokenLogprob, token_logprobs
from runahead.store.link import check_link_bandwidth

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(slots=True)
class _RequestState:
    spec: RequestSpec
    kv: RequestStateMLX
    sampler: Sampler
    position: int = 0  # tokens already in the KV cache
    last_token: int | None = None
    hidden: mx.array | None = None  # [tokens, H] residual stream between jobs
    weights: mx.array | None = None  # [tokens, k] their routing weights
    routing: np.ndarray | None = None  # [tokens, k] experts the gate chose for the next MoE (host)
    normed: mx.array | None = None  # [tokens, H] what the next MoE's experts read (model.expert_input)
    products: mx.array | None = None  # [tokens, k, H] a waved job's weighted products so far
    logits: list[np.ndarray] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet taken
    token_logprob: TokenLogprob | None = None  # of the last sampled token, not yet taken


def resolve_device(device: str) -> Any:
    """An MLX device from a name: ``cpu``, ``gpu`` / ``metal``, or ``auto`` (the GPU where Metal is)."""
    if device == "auto":
        return mx.gpu if mx.metal.is_available() else mx.cpu
    if device == "cpu":
        return mx.cpu
    if device in ("gpu", "metal", "mps"):
        if not mx.metal.is_available():
            raise ValueError(f"device {device!r}: Metal is not available (MLX's CPU build?); use cpu")
        return mx.gpu
    raise ValueError(f"unknown MLX device {device!r}; expected auto, cpu or gpu")


def resolve_dtype(dtype: str, device: Any) -> Any:
    """The compute dtype of float weights: a name, or ``auto`` (float32 on the CPU, where bf16 is
    ~7x slower; the checkpoint's own dtype on the GPU, as mlx-lm runs it). None keeps the file's."""
    if dtype == "auto":
        return mx.float32 if device == mx.cpu else None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


class MLXBackend(RequestLifecycle[_RequestState]):
    """A :class:`runahead.backend.Backend` over an :class:`MLXModel`, an expert reader and slot pools."""

    def __init__(
        self,
        model: MLXModel,
        checkpoint: Checkpoint,
        pools: SlotPools,
        reader: ExpertReader,
        *,
        host_experts: dict[tuple[int, int], dict[str, np.ndarray]] | None = None,
        speculate: bool = False,
        keep_logits: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        """``host_experts``: every expert's host buffers (the ``host`` store) instead of reads from
        disk. ``speculate``, ``keep_logits``, ``batch_invariant``: as for the torch backend."""
        self.model = model
        self.checkpoint = checkpoint
        self.pools = pools
        self.store = reader
        self.host_experts = host_experts
        self.speculate = speculate
        self.keep_logits = keep_logits
        self.batch_invariant = batch_invariant
        config = model.config
        self.num_layers: int = config.num_layers
        self.num_experts: int = config.num_experts
        self.experts_per_job: int = config.top_k
        super().__init__()
        self._owners = SlotOwners()
        self._compute_thread = self._start_compute_thread("runahead-mlx-compute", wanted_nice())

    @classmethod
    def open(
        cls,
        path: str,
        *,
        cache_slots: int | None = None,
        cache_fraction: float | None = None,
        device: str = "auto",
        store: str = "disk",
        queue_depth: int = READS_IN_FLIGHT,
        dtype: str = "auto",
        link_bandwidth: float | None = None,
        **options: Any,
    ) -> MLXBackend:
        """Load the Hugging Face or mlx-lm folder ``path`` and build a backend with cache slots.

        The cache has ``cache_slots`` slots, or ``cache_fraction`` of all routed experts (at least
        one job's top-k). ``store``: ``disk`` (O_DIRECT reads of the model's files) or ``host``
        (every expert read into host memory once). ``device``: ``auto``, ``cpu`` or ``gpu``;
        ``dtype``: see :func:`resolve_dtype`. ``link_bandwidth`` (bytes per second): every fetch takes
        at least as long as its bytes take over a serial link of that rate
        (:class:`runahead.store.LinkCap`). ``options`` go to the constructor.
        """
        if (cache_slots is None) == (cache_fraction is None):
            raise ValueError("give exactly one of cache_slots and cache_fraction")
        if cache_fraction is not None and not 0 < cache_fraction <= 1:
            raise ValueError(f"cache fraction must lie in (0, 1], got {cache_fraction}")
        if link_bandwidth is not None:
            check_link_bandwidth(link_bandwidth)  # before the model loads
        wanted_nice()  # a bad $RUNAHEAD_COMPUTE_NICE is refused before the model loads
        if store not in ("disk", "host"):
            raise ValueError(f"unknown expert store {store!r}; expected 'disk' or 'host'")
        where = resolve_device(device)
        mx.set_default_device(where)
        kind = resolve_dtype(dtype, where)
        checkpoint = load_checkpoint(path, kind)
        config = checkpoint.config
        model = mlx_architecture(config.model_type)(checkpoint)
        if cache_slots is None:
            assert cache_fraction is not None
            cache_slots = max(config.top_k, round(cache_fraction * config.num_layers * config.num_experts))
        float_dtype = kind or next(a.dtype for k, a in checkpoint.weights.items() if k == "norm")
        pools = SlotPools(checkpoint, cache_slots, float_dtype)
        reader = ExpertReader(checkpoint.experts, queue_depth=queue_depth, link_bandwidth=link_bandwidth)
        host: dict[tuple[int, int], dict[str, np.ndarray]] | None = None
        if store == "host":
            host = {key: {} for key in checkpoint.experts}
            for key, pieces in checkpoint.experts.items():
                reader._read_blocking(pieces, host[key])
        return cls(model, checkpoint, pools, reader, host_experts=host, **options)

    @property
    def num_slots(self) -> int:
        """Cache slots the backend holds: the runtime's ``cache_slots``."""
        return self.pools.num_slots

    @property
    def compute_dtype(self) -> str:
        """The float dtype experts and activations compute in (``float32``, ``bfloat16``, ...)."""
        return str(self.pools.dtype).removeprefix("mlx.core.")

    # -- request lifecycle -------------------------------------------------------------------------

    backend_name = "mlx"

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _new_state(self, request: RequestSpec, sampler: Sampler) -> _RequestState:
        return _RequestState(request, self.model.new_state(), sampler)

    # -- the link ----------------------------------------------------------------------------------

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        self._owners.claim(key, slot)
        if self.host_experts is not None:
            await self.store.carry(key.layer, key.expert)
            tensors = self.host_experts[key.layer, key.expert]
        else:
            tensors = await self.store.read(key.layer, key.expert)
        self.pools.stage(slot, tensors)
        self._owners.filled(key, slot)

    # -- compute -----------------------------------------------------------------------------------

    def _compute(self, group: Group) -> list[JobResult]:
        """One backend call: install staged experts, then every job of the group as one batch."""
        self.pools.install()
        if self.batch_invariant and len(group.jobs) > 1:
            return [r for job in group.jobs for r in self._run(Group(group.layer, (job,)))]
        return self._run(group)

    def _run(self, group: Group) -> list[JobResult]:
        layer, jobs = group.layer, group.jobs
        states = [self._requests[job.request] for job in jobs]
        if layer == ENTRY_LAYER:
            tokens = [
                t
                for state, job in zip(states, jobs, strict=True)
                for t in input_tokens(state.spec, state.position, state.last_token, job)
            ]
            hidden = self.model.embed(mx.array(tokens, dtype=mx.int32))
            final = list(range(len(jobs)))
        else:
            hidden, final = self._moe(layer, jobs, states)
        out: list[JobResult | None] = [JobResult(job) if job.remaining else None for job in jobs]
        if final:
            spans = row_spans(jobs)
            kept = [(jobs[i], states[i]) for i in final]
            rows = [hidden[spans[i][0] : spans[i][1]] for i in final]
            finished = self._finish(layer, mx.concatenate(rows) if len(rows) > 1 else rows[0], kept)
            for i, result in zip(final, finished, strict=True):
                out[i] = result
        return [r for r in out if r is not None]

    def _moe(
        self, layer: int, jobs: Sequence[Job], states: list[_RequestState]
    ) -> tuple[mx.array, list[int]]:
        """This wave's routed experts for every job (one gathered matmul per matrix over slot
        indices); finish the MoE of jobs whose last wave this is. Returns the rows and those jobs."""
        hidden_parts, normed_parts, slot_rows, weight_parts, masks = [], [], [], [], []
        owned: dict[int, int] = {}  # expert -> its slot, for every job of the group
        for state, job in zip(states, jobs, strict=True):
            if state.hidden is None or state.weights is None or state.routing is None or state.normed is None:
                raise RuntimeError(
                    f"request {job.request} has no hidden state for its MoE job: jobs ran out of order"
                )
            single = not job.remaining and job.wave == 0
            wave = set(job.experts) if not single else None
            slots, mask = self._slots(layer, state.routing, wave, owned)
            hidden_parts.append(state.hidden)
            normed_parts.append(state.normed)
            slot_rows.append(slots)
            masks.append(mask)
            if mask is None:
                weight_parts.append(state.weights)
            else:
                weight_parts.append(state.weights * mx.array(mask, dtype=state.weights.dtype))
        hidden, normed = _cat(hidden_parts), _cat(normed_parts)
        indices = mx.array(np.concatenate(slot_rows), dtype=mx.uint32)
        weights = _cat(weight_parts)
        products, dtype = self.model.moe_products(layer, hidden, indices, weights, self.pools.pools, normed)
        routed = moe_sum(products, dtype) if any(mask is None for mask in masks) else None
        spans = row_spans(jobs)
        final, outputs = [], []
        for i, (state, job, mask) in enumerate(zip(states, jobs, masks, strict=True)):
            start, stop = spans[i]
            if mask is not None:  # waves: keep each pair's product from its wave until the last
                mine = products[start:stop]
                kept = state.products if state.products is not None else mx.zeros_like(mine)
                state.products = mx.where(mx.array(mask.astype(bool))[..., None], mine, kept)
            if job.remaining:
                outputs.append(hidden[start:stop])
                continue
            if mask is None:
                assert routed is not None
                part = routed[start:stop]
            else:  # summed as one wave sums them (the same adds in the same order)
                assert state.products is not None
                part, state.products = moe_sum(state.products, dtype), None
            outputs.append(self.model.moe_finish(layer, hidden[start:stop], part, normed[start:stop]))
            final.append(i)
        pending = [s.products for s in states if s.products is not None]
        if pending:
            mx.eval(pending)  # a later wave must not keep this wave's slots in a lazy graph
        return _cat(outputs), final

    def _slots(
        self, layer: int, routing: np.ndarray, wave: set[int] | None, owned: dict[int, int]
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Slot indices ``[T, k]`` of a job's routing; with a ``wave``, a 0/1 mask of its pairs (pairs
        outside it point at the slot of its lowest expert and weigh 0). ``owned``: expert -> slot,
        shared by a group's jobs (one lookup an expert a group); only resident experts enter it."""
        pairs = routing.ravel().tolist()
        wanted = set(pairs) if wave is None else wave
        for expert in wanted.difference(owned):
            owned[expert] = self._owners.slot(ExpertKey(layer, expert))
        if wave is None:
            return np.array([owned[e] for e in pairs], dtype=np.uint32).reshape(routing.shape), None
        fill = owned[min(wave)]
        slots = np.array([owned[e] if e in wave else fill for e in pairs], dtype=np.uint32)
        inside = np.array([e in wave for e in pairs], dtype=np.float32)
        return slots.reshape(routing.shape), inside.reshape(routing.shape)

    def _finish(self, layer: int, hidden: mx.array, kept: list[tuple[Job, _RequestState]]) -> list[JobResult]:
        """After the MoE: sample at the last layer, else the next layer's attention and gate."""
        model = self.model
        spans = row_spans([job for job, _ in kept])
        if layer == self.num_layers - 1:
            return self._sample(kept, spans, hidden)
        following = layer + 1
        segments = [(state.kv, state.position, job.num_tokens) for job, state in kept]
        hidden = model.attention(following, hidden, segments)
        normed = model.expert_input(following, hidden)  # once a job: the router may read it too
        ids, weights = model.route(following, hidden, normed if model.post_norm_feeds_all else None)
        guess = None
        if self.speculate and following + 1 < self.num_layers:
            guess = model.route(following + 1, hidden)[0]
        outputs: list[mx.array] = [hidden, normed, ids, weights] + ([guess] if guess is not None else [])
        mx.eval(outputs + [a for _, state in kept for a in state.kv.arrays()])
        routing = np.array(ids)
        guesses = np.array(guess) if guess is not None else None
        out = []
        for (job, state), (start, stop) in zip(kept, spans, strict=True):
            state.hidden, state.weights = hidden[start:stop], weights[start:stop]
            state.routing, state.normed = routing[start:stop], normed[start:stop]
            predicted = distinct_experts(guesses[start:stop]) if guesses is not None else ()
            out.append(JobResult(job, distinct_experts(state.routing), predicted))
        return out

    def _sample(
        self, kept: list[tuple[Job, _RequestState]], spans: list[tuple[int, int]], hidden: mx.array
    ) -> list[JobResult]:
        """Tokens from the last row of each job (a prompt chunk before the last samples nothing)."""
        ends = mx.array([stop - 1 for _, stop in spans], dtype=mx.int32)
        logits = self.model.logits(hidden[ends]).astype(mx.float32)
        greedy = mx.argmax(logits, axis=-1)
        scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        prompts = self._score_prompts(kept, spans, hidden)
        kv = [a for _, state in kept for a in state.kv.arrays()]
        mx.eval([logits, greedy, scores, *(rows for _, _, rows, _ in prompts), *kv])
        for state, targets, rows, top in prompts:
            state.prompt_logprobs += token_logprobs(_torch(rows), targets, top)
        tokens = np.array(greedy).tolist()
        host = (
            np.array(logits)
            if self.keep_logits or not all(s.sampler.params.greedy for _, s in kept)
            else None
        )
        out = []
        for row, (job, state) in enumerate(kept):
            state.position += job.num_tokens
            state.hidden = state.normed = state.weights = state.routing = None
            if job.prefill and state.position < len(state.spec.prompt):
                out.append(JobResult(job))
                continue
            if self.keep_logits:
                assert host is not None
                state.logits.append(host[row])
            if state.sampler.params.greedy:
                state.last_token = int(tokens[row])
            else:
                assert host is not None
                state.last_token = state.sampler.sample(_torch(host[row]))
            ranked = state.sampler.params.logprobs
            if ranked is not None:
                (state.token_logprob,) = token_logprobs(
                    _torch(scores[row : row + 1]), [state.last_token], ranked
                )
            out.append(JobResult(job, token=state.last_token))
        return out

    def _score_prompts(
        self, kept: list[tuple[Job, _RequestState]], spans: list[tuple[int, int]], hidden: mx.array
    ) -> list[tuple[_RequestState, list[int], mx.array, int]]:
        """For requests with ``prompt_logprobs``: row ``i`` of a prompt chunk scores prompt token
        ``i + 1`` (log-softmax of the LM head over the chunk's rows; no extra pass over the prompt)."""
        pending = []
        for (job, state), (start, _) in zip(kept, spans, strict=True):
            top = state.sampler.params.prompt_logprobs
            if not job.prefill or top is None:
                continue
            targets = list(state.spec.prompt[state.position + 1 : state.position + job.num_tokens + 1])
            if targets:
                rows = self.model.logits(hidden[start : start + len(targets)]).astype(mx.float32)
                pending.append((state, targets, rows - mx.logsumexp(rows, axis=-1, keepdims=True), top))
        return pending


def _torch(values: Any) -> Any:
    """A float32 torch tensor of an MLX or numpy array (for the shared sampler and log-prob scoring)."""
    import torch

    return torch.from_numpy(np.array(values, dtype=np.float32))


def _cat(parts: list[mx.array]) -> mx.array:
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]
