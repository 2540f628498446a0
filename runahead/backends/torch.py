"""The ``torch`` backend: real MoE models on CPU or CUDA, experts fetched into cache slots.

Non-expert weights (embeddings, attention, norms, routers, shared experts, LM head) stay resident in
the model; routed experts reach the device only through :meth:`TorchBackend.fetch`, which asks the
expert store (O_DIRECT reads of the model's own files, or host memory) to fill a cache slot.

``compute(group)`` runs one job for every request of the group as one batch: the MoE of the layer
(each distinct expert once over the rows routed to it), then the next layer's attention (each
request over its own KV cache) and gate, whose top-k becomes the request's next job. At the last
layer it produces logits and samples. The work runs on a dedicated compute thread so the event
loop, and with it the link, never waits for the accelerator.

Prompts go through the same jobs in chunks (prefill): a chunk's tokens route to many experts, so
the runtime runs such a job's MoE in waves that each fit the cache, and the backend sums them.

On CUDA nothing in a group's compute waits for the device except one read of the small results
the runtime needs (the next layer's routing, or the sampled tokens): they are copied into pinned
host memory without blocking and waited for once, after every kernel of the group is launched
(:class:`_Readback`). The MoE takes its rows per expert from the routing already read back, so it
never reads the device. A group whose results need nothing from the device (waves of a prefill
chunk) returns as soon as it is launched: its slots may be unpinned while its kernels still run,
so each slot keeps an event recorded after the last group that read it, and the store's copy into
that slot waits for the event on the copy stream (:meth:`TorchBackend.fetch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from runahead.backend import READS_IN_FLIGHT
from runahead.backends.common import (
    RequestLifecycle,
    SlotOwners,
    distinct_experts,
    input_tokens,
    row_spans,
)
from runahead.backends.priority import resolve_nice
from runahead.backends.threads import threads_for
from runahead.backends.torch_load import load_for_open
from runahead.backends.waves import sums_with_waves
from runahead.jobs import ENTRY_LAYER, ExpertKey, Group, Job, JobResult, RequestSpec
from runahead.models.hostcopy import int_tensor
from runahead.models.routing import ExpertRows
from runahead.sampling import Sampler, TokenLogprob, token_logprobs
from runahead.store.link import check_link_bandwidth


@dataclass(slots=True)
class _RequestState:
    spec: RequestSpec
    cache: Any  # the model's KV cache for this request
    sampler: Sampler
    position: int = 0  # tokens already in the KV cache
    last_token: int | None = None
    hidden: torch.Tensor | None = None  # [tokens, H] residual stream between jobs
    normed: torch.Tensor | None = None  # [tokens, H] what the next MoE's experts read (model.expert_input)
    weights: torch.Tensor | None = None  # [tokens, k] their routing weights
    partials: torch.Tensor | None = None  # [tokens, k, H] a waved job's products so far (backends.waves)
    routing: list[list[int]] | None = None  # experts the gate chose for the next MoE, one row per token
    logits: list[torch.Tensor] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet taken
    token_logprob: TokenLogprob | None = None  # of the last sampled token, not yet taken


class TorchBackend(RequestLifecycle[_RequestState]):
    """A :class:`runahead.backend.Backend` over a torch ``MoEModel``, an expert store and slots."""

    def __init__(
        self,
        model: Any,
        store: Any,
        slots: Any,
        *,
        speculate: bool = False,
        keep_logits: bool = False,
        batch_invariant: bool = False,
        compute_nice: int | str | None = "auto",
    ) -> None:
        """``model``: a :class:`runahead.models.base.MoEModel`; ``store``: an ExpertStore;
        ``slots``: the SlotPool the runtime's cache slots index. ``speculate`` also applies the
        following layer's gate to each hidden state (the prefetch-gate baselines use it; a runtime
        turns it on or off for its policy);
        ``keep_logits`` keeps every sampled step's logits (tests compare them);
        ``batch_invariant`` computes each job of a group on its own, so a request's arithmetic, and
        with it its tokens, does not depend on what the schedule batched it with (slower: shared
        weights are read once per job). Matrix products round differently for different numbers
        of rows, and top-k routing can turn a last-bit difference into a different expert.
        ``compute_nice``: the compute thread's scheduling priority on Linux (``auto``: -10, or
        ``$RUNAHEAD_COMPUTE_NICE``; None leaves it alone): :mod:`runahead.backends.priority`.
        """
        nice = resolve_nice(compute_nice)  # refused before anything starts
        self.model = model
        self.store = store
        self.slots = slots
        self.speculate = speculate
        self.keep_logits = keep_logits
        self.batch_invariant = batch_invariant
        config = model.config
        self.num_layers: int = config.num_layers
        self.num_experts: int = config.num_experts
        self.experts_per_job: int = config.top_k
        super().__init__()
        self._owners = SlotOwners()
        self._cuda = self.slots.device.type == "cuda"
        model.use_slot_pool(self.slots.data)  # grouped expert products over the cache, where they pay
        self._fences: dict[int, Any] = {}  # slot -> CUDA event after the last kernels that read it
        self._compute_thread = self._start_compute_thread("runahead-compute", nice)
        self.compute_threads = torch.get_num_threads()  # torch's intra-op threads (``open`` sets them)

    @classmethod
    def open(
        cls,
        path: str,
        *,
        cache_slots: int | None = None,
        cache_fraction: float | None = None,
        device: str = "cpu",
        store: Literal["disk", "host"] = "disk",
        queue_depth: int = READS_IN_FLIGHT,
        dtype: torch.dtype | str = torch.float32,
        expert_slots: Literal["auto", "stored", "compute"] = "auto",
        link_bandwidth: float | None = None,
        threads: int | str = "auto",
        **options: Any,
    ) -> TorchBackend:
        """Load the Hugging Face folder (or ``.gguf`` file) ``path`` and build a backend with cache slots.

        The cache has ``cache_slots`` slots, or ``cache_fraction`` of all routed experts (at least
        one job's top-k); the runtime's cache must use :attr:`num_slots`. ``store`` is ``disk``
        (O_DIRECT reads of the model's safetensors files) or ``host`` (every expert copied into host
        memory once, pinned on CUDA). ``dtype`` is the compute and slot dtype, or its name
        (:func:`runahead.backends.dtypes.resolve_dtype`: ``auto`` is bfloat16 on CUDA and the faster
        of float32 and bfloat16 at the model's shapes on CPU, measured once per process; float32 on
        CPU wherever the stored-expert kernel multiplies the experts as the file stores them, a GGUF or
        a bf16/f16 checkpoint unless ``expert_slots="compute"``, except a bf16 checkpoint whose experts
        multiply faster with bfloat16 rows on this CPU's kernel:
        :func:`runahead.backends.torch_load.stored_compute_dtype`).
        ``expert_slots``: how the cache holds a safetensors checkpoint's experts: ``compute`` in the
        compute dtype (widened on the way in), ``stored`` as the file stores them (bfloat16 or
        float16, half the bytes of float32, multiplied as stored by the CPU kernel: float32 compute
        on CPU only), ``auto`` stored wherever that applies
        (:func:`~runahead.backends.torch_load.stored_slots`). A GGUF's experts are always kept as
        stored. ``link_bandwidth`` (bytes per second): the store's reads are paced
        to a serial link of that rate (:class:`runahead.store.LinkCap`), a steady stand-in for a
        device's link. ``threads``: torch's intra-op threads on CPU, a count or ``auto`` (every core
        but one: :mod:`runahead.backends.threads`; a process-wide setting, set here before anything is
        timed or loaded). ``options`` go to the constructor.
        """
        from runahead.store import SlotPool, make_store

        if (cache_slots is None) == (cache_fraction is None):
            raise ValueError("give exactly one of cache_slots and cache_fraction")
        if cache_fraction is not None and not 0 < cache_fraction <= 1:
            raise ValueError(f"cache fraction must lie in (0, 1], got {cache_fraction}")
        if link_bandwidth is not None:
            check_link_bandwidth(link_bandwidth)  # before the model loads
        resolve_nice(options.get("compute_nice", "auto"))  # so is a bad compute_nice
        with threads_for(threads, device) as compute_threads:  # set before the dtype is timed
            model, layout, dtype = load_for_open(path, device, dtype, expert_slots)
            if cache_slots is None:
                assert cache_fraction is not None
                config = model.config
                experts = config.num_layers * config.num_experts
                cache_slots = max(config.top_k, round(cache_fraction * experts))
            slots = SlotPool.for_layout(cache_slots, layout, dtype=dtype, device=device)
            expert_store = make_store(
                store, layout, queue_depth=queue_depth, dtype=dtype, link_bandwidth=link_bandwidth
            )
            backend = cls(model, expert_store, slots, **options)
        backend.compute_threads = compute_threads
        return backend

    @property
    def compute_dtype(self) -> str:
        """The dtype the model computes in (``float32``, ``bfloat16``, ...)."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def num_slots(self) -> int:
        """Cache slots the backend holds: the runtime's ``cache_slots``."""
        return int(self.slots.num_slots)

    # -- request lifecycle -------------------------------------------------------------------------

    backend_name = "torch"

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _new_state(self, request: RequestSpec, sampler: Sampler) -> _RequestState:
        return _RequestState(request, self.model.new_cache(), sampler)

    # -- the link ----------------------------------------------------------------------------------

    async def fetch(self, key: ExpertKey, slot: int) -> float | None:
        self._owners.claim(key, slot)
        after = self._fences.pop(slot, None)  # kernels still reading the slot's previous expert
        landed: float | None
        if after is None:
            landed = await self.store.read_into(key.layer, key.expert, self.slots.slot(slot))
        else:
            landed = await self.store.read_into(key.layer, key.expert, self.slots.slot(slot), after=after)
        self._owners.filled(key, slot)
        return landed

    # -- compute -----------------------------------------------------------------------------------

    def compute_inline(self, group: Group) -> list[JobResult]:
        """``compute`` on the caller's thread (:class:`runahead.backend.InlineCompute`): the same
        work, timed the same way, without the two hand-offs to the compute thread. (The mlx backend
        has none: MLX's streams belong to the thread that made them.)"""
        return self._timed_compute(group, inline=True)

    @torch.inference_mode()
    def _compute(self, group: Group) -> list[JobResult]:
        """One backend call: every job of the group as one batch of rows (a job has one row per token).

        Launches everything first, then waits (once, on CUDA) for what the results read.
        """
        readback = _Readback(self.slots.device)
        if self.batch_invariant and len(group.jobs) > 1:
            parts = [self._launch(Group(group.layer, (job,)), readback) for job in group.jobs]
        else:
            parts = [self._launch(group, readback)]
        self._fence(group)
        readback.wait()
        return [result for results in parts for result in results()]

    def _launch(self, group: Group, readback: _Readback) -> Callable[[], list[JobResult]]:
        """Launch one batch's work; returns what builds its results once ``readback`` has waited."""
        model, layer, jobs = self.model, group.layer, group.jobs
        states = [self._requests[job.request] for job in jobs]
        if layer == ENTRY_LAYER:
            tokens = [
                t
                for state, job in zip(states, jobs, strict=True)
                for t in input_tokens(state.spec, state.position, state.last_token, job)
            ]
            hidden = model.embed(int_tensor(tokens, self.slots.device))
            final = list(range(len(jobs)))
        else:
            hidden, final = self._moe(layer, jobs, states)
        finished: Callable[[], list[JobResult]] = list
        if final:
            kept = [(jobs[i], states[i]) for i in final]
            finished = self._finish(layer, hidden, kept, readback)

        def results() -> list[JobResult]:
            out: list[JobResult | None] = [JobResult(job) if job.remaining else None for job in jobs]
            for i, result in zip(final, finished(), strict=True):
                out[i] = result
            return [r for r in out if r is not None]

        return results

    def _moe(
        self, layer: int, jobs: Sequence[Job], states: list[_RequestState]
    ) -> tuple[torch.Tensor, list[int]]:
        """This wave's routed experts for every job; finish the MoE of jobs whose last wave this is.

        Returns the MoE output rows of the jobs that finished their MoE (in group order) and those
        jobs' indices. A job only adds the experts of its own wave, even when
        another job of the group computes one of its other experts. A job in waves keeps its
        products until its last wave and sums them then, in the order one wave would have
        (:mod:`runahead.backends.waves`), so its result does not depend on how it was split.
        """
        carried = [_carried(state, job.request) for state, job in zip(states, jobs, strict=True)]
        hidden, weights, normed = (_joined([c[i] for c in carried]) for i in range(3))
        wanted = {e for job in jobs for e in job.experts}
        experts = {e: self._slot_tensor(ExpertKey(layer, e)) for e in wanted}
        routing = self._routing(jobs, states, wanted)
        rows = row_spans(jobs)
        waved = [(i, states[i], not job.remaining) for i, job in enumerate(jobs) if job.wave or job.remaining]
        if not waved:
            accumulated = self.model.moe_partial(layer, hidden, None, weights, experts, None, routing, normed)
        else:
            y = self.model.moe_products(layer, hidden, weights, experts, routing, normed)
            accumulated = sums_with_waves(y, routing, rows, hidden, weights.shape[-1], waved)
        final = [i for i, job in enumerate(jobs) if not job.remaining]
        if not final:
            return hidden[:0], final
        if len(final) < len(jobs):
            keep = torch.cat([torch.arange(*rows[i], device=hidden.device) for i in final])
            hidden, accumulated, normed = hidden[keep], accumulated[keep], normed[keep]
        # One call for every finished row: the shared expert's weights are read once per group.
        return self.model.moe_finish(layer, hidden, accumulated, normed), final

    def _routing(self, jobs: Sequence[Job], states: list[_RequestState], wanted: set[int]) -> ExpertRows:
        """The group's (row, k) pairs of this wave, sorted by expert, from the host copy of the
        routing (no device read); one copy to the device. A job's pairs are those of its own wave."""
        rows: list[list[int]] = []
        for job, state in zip(jobs, states, strict=True):
            if state.routing is None:
                raise RuntimeError(f"request {job.request} has no routing for its MoE job")
            wave = wanted if not job.remaining and job.wave == 0 else wanted & set(job.experts)
            rows.extend([e if e in wave else -1 for e in row] for row in state.routing)
        return ExpertRows.from_host(rows, wanted, self.slots.device)

    def _finish(
        self, layer: int, hidden: torch.Tensor, kept: list[tuple[Job, _RequestState]], readback: _Readback
    ) -> Callable[[], list[JobResult]]:
        """After the MoE: sample at the last layer, else the next layer's attention and gate."""
        model = self.model
        spans = row_spans([job for job, _ in kept])
        if layer == self.num_layers - 1:
            ends = int_tensor([stop - 1 for _, stop in spans], self.slots.device)
            scored = self._score_prompts(kept, spans, hidden, readback)
            sampled = self._sample(kept, model.logits(hidden[ends]), readback)
            return lambda: (scored(), sampled())[1]
        following = layer + 1
        segments = [(state.cache, state.position, job.num_tokens) for job, state in kept]
        hidden = model.attention(following, hidden, segments)
        normed = model.expert_input(following, hidden)  # once a job: the router may read it too
        ids, weights = model.route(following, hidden, normed if model.post_norm_feeds_all else None)
        for (_, state), (start, stop) in zip(kept, spans, strict=True):
            state.hidden, state.normed = hidden[start:stop], normed[start:stop]
            state.weights = weights[start:stop]
        host_ids = readback.add(ids)
        host_guess = None
        if self.speculate and following + 1 < self.num_layers:
            host_guess = readback.add(model.route(following + 1, hidden)[0])

        def results() -> list[JobResult]:
            routing: list[list[int]] = host_ids.tolist()
            guesses: list[list[int]] | None = host_guess.tolist() if host_guess is not None else None
            out = []
            for (job, state), (start, stop) in zip(kept, spans, strict=True):
                state.routing = routing[start:stop]
                guess = distinct_experts(guesses[start:stop]) if guesses is not None else ()
                out.append(JobResult(job, distinct_experts(state.routing), guess))
            return out

        return results

    def _score_prompts(
        self,
        kept: list[tuple[Job, _RequestState]],
        spans: list[tuple[int, int]],
        hidden: torch.Tensor,
        readback: _Readback,
    ) -> Callable[[], None]:
        """For requests with ``prompt_logprobs``: the rows of a prompt chunk predict the prompt's next
        tokens, so their log-softmax scores every prompt token after the first."""
        pending = []
        for (job, state), (start, _) in zip(kept, spans, strict=True):
            top = state.sampler.params.prompt_logprobs
            if not job.prefill or top is None:
                continue
            targets = state.spec.prompt[state.position + 1 : state.position + job.num_tokens + 1]
            if targets:
                logits = self.model.logits(hidden[start : start + len(targets)]).float()
                pending.append((state, targets, readback.add(torch.log_softmax(logits, dim=-1)), top))

        def store() -> None:
            for state, targets, logprobs, top in pending:
                state.prompt_logprobs += token_logprobs(logprobs, targets, top)

        return store

    def _sample(
        self, kept: list[tuple[Job, _RequestState]], logits: torch.Tensor, readback: _Readback
    ) -> Callable[[], list[JobResult]]:
        """Tokens from the last rows' logits. On CUDA greedy rows are argmax'ed on the device and
        only their tokens read back; logits come back only where a sampler or ``keep_logits`` needs them."""
        sampled = [
            not (job.prefill and state.position + job.num_tokens < len(state.spec.prompt))
            for job, state in kept
        ]  # a prompt chunk before the last has nothing to sample
        rows = logits.float()
        tokens = host = scores = None
        scoring = [
            s and state.sampler.params.logprobs is not None
            for s, (_, state) in zip(sampled, kept, strict=True)
        ]
        if any(scoring):
            scores = readback.add(torch.log_softmax(rows, dim=-1))
        if any(sampled):
            greedy = all(state.sampler.params.greedy for _, state in kept)
            if self._cuda:
                tokens = readback.add(torch.argmax(rows, dim=-1))
            if not self._cuda or self.keep_logits or not greedy:
                host = readback.add(rows)

        def results() -> list[JobResult]:
            out = []
            for row, (job, state) in enumerate(kept):
                state.position += job.num_tokens
                state.hidden = state.normed = state.weights = state.routing = None
                if not sampled[row]:
                    out.append(JobResult(job))
                    continue
                if self.keep_logits:
                    assert host is not None
                    state.logits.append(host[row])
                if tokens is not None and state.sampler.params.greedy:
                    state.last_token = int(tokens[row])
                else:
                    assert host is not None
                    state.last_token = state.sampler.sample(host[row])
                top = state.sampler.params.logprobs
                if top is not None:
                    assert scores is not None
                    (state.token_logprob,) = token_logprobs(scores[row : row + 1], [state.last_token], top)
                out.append(JobResult(job, token=state.last_token))
            return out

        return results

    def _fence(self, group: Group) -> None:
        """On CUDA: record an event after the group's kernels; a later fetch into one of the group's
        slots waits for it on the copy stream, so pins may be released before the kernels finish."""
        if not self._cuda:
            return
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        for job in group.jobs:
            for key in job.keys:
                slot = self._owners.slot_of.get(key)
                if slot is not None:
                    self._fences[slot] = done

    def _slot_tensor(self, key: ExpertKey) -> torch.Tensor:
        slot = self._owners.slot(key)
        tensor: torch.Tensor = self.slots.slot(slot)
        return tensor


class _Readback:
    """The small tensors a group's results need on the host, read with at most one wait per group.

    On CPU a tensor is kept as it is. On CUDA :meth:`add` starts a non-blocking copy into pinned
    host memory on the compute stream right away; :meth:`wait` records one event after the last
    copy and waits for it (the thread waits, not the event loop). Tensors :meth:`add` returns are
    valid once :meth:`wait` has returned.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.copies = 0

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self.copies += 1
        return host

    def wait(self) -> None:
        if self.cuda and self.copies:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            done.synchronize()


def _carried(state: _RequestState, request: int) -> tuple[torch.Tensor, ...]:
    """The residual stream, routing weights and experts' input a request's previous job left for this one."""
    if state.hidden is None or state.weights is None or state.normed is None:
        raise RuntimeError(f"request {request} has no hidden state for its MoE job: jobs ran out of order")
    return state.hidden, state.weights, state.normed


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The jobs' rows as one tensor (a single job's as they are: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
