"""The ``torch`` backend: real MoE models on CPU or CUDA, experts fetched into cache slots.

Non-expert weights (embeddings, attention, norms, routers, shared experts, LM head) stay resident in
the model; routed experts reach the device only through :meth:`TorchBackend.fetch`, which asks the
expert store (O_DIRECT reads of the model's own files, or host memory) to fill a cache slot.

``compute(group)`` runs one job for every request of the group as one batch: the MoE of the layer
(each distinct expert once over the rows routed to it), then the next layer's attention (each
request over its own KV cache) and gate, whose top-k becomes the request's next job. At the last
layer it produces logits and samples. The work runs on a dedicated compute thread so the event
loop, and with it the link, never waits for the accelerator.

Prompts are fed one token per step through the same jobs (teacher forcing), so a prompt never needs
more experts at once than a decode step; chunked prefill comes with continuous batching.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from runahead.jobs import ENTRY_LAYER, ExpertKey, Group, JobResult, RequestSpec
from runahead.sampling import Sampler, SamplingParams


@dataclass(slots=True)
class _RequestState:
    spec: RequestSpec
    cache: Any  # the model's KV cache for this request
    sampler: Sampler
    position: int = 0  # tokens already in the KV cache
    last_token: int | None = None
    hidden: torch.Tensor | None = None  # [1, H] residual stream between jobs
    ids: torch.Tensor | None = None  # [1, k] experts the gate chose for the next MoE
    weights: torch.Tensor | None = None  # [1, k] their routing weights
    logits: list[torch.Tensor] = field(default_factory=list)


class TorchBackend:
    """A :class:`runahead.backend.Backend` over a torch ``MoEModel``, an expert store and slots."""

    def __init__(
        self,
        model: Any,
        store: Any,
        slots: Any,
        *,
        speculate: bool = True,
        keep_logits: bool = False,
    ) -> None:
        """``model``: a :class:`runahead.models.base.MoEModel`; ``store``: an ExpertStore;
        ``slots``: the SlotPool the runtime's cache slots index. ``speculate`` also applies the
        following layer's gate to each hidden state (the prefetch-gate baselines use it);
        ``keep_logits`` keeps every sampled step's logits (tests compare them).
        """
        self.model = model
        self.store = store
        self.slots = slots
        self.speculate = speculate
        self.keep_logits = keep_logits
        config = model.config
        self.num_layers: int = config.num_layers
        self.experts_per_job: int = config.top_k
        self._requests: dict[int, _RequestState] = {}
        self._slot_owner: dict[int, ExpertKey] = {}
        self._slot_of: dict[ExpertKey, int] = {}
        self._compute_thread = ThreadPoolExecutor(1, thread_name_prefix="runahead-compute")

    @classmethod
    def open(
        cls,
        path: str,
        *,
        cache_slots: int,
        device: str = "cpu",
        store: Literal["disk", "host"] = "disk",
        queue_depth: int = 2,
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> TorchBackend:
        """Load the Hugging Face folder ``path`` and build a backend with ``cache_slots`` expert slots.

        ``store`` is ``disk`` (O_DIRECT reads of the model's safetensors files) or ``host`` (every
        expert copied into host memory once, pinned on CUDA). ``options`` go to the constructor.
        """
        from runahead.models import load_model
        from runahead.store import SlotPool, make_store

        model, layout = load_model(path, device=device, dtype=dtype)
        slots = SlotPool(cache_slots, layout.slot_numel, dtype=dtype, device=device)
        expert_store = make_store(store, layout, queue_depth=queue_depth, dtype=dtype)
        return cls(model, expert_store, slots, **options)

    # -- request lifecycle -------------------------------------------------------------------------

    def open_request(self, request: RequestSpec) -> None:
        if not request.prompt:
            raise ValueError(f"request {request.request}: the torch backend needs a non-empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request.request}: prompt token ids {bad[:5]} are outside [0, {vocab})"
            )
        params = request.sampling or SamplingParams(max_tokens=request.max_tokens)
        self._requests[request.request] = _RequestState(request, self.model.new_cache(), Sampler(params))

    def close_request(self, request: int) -> None:
        self._requests.pop(request, None)

    def logits_of(self, request: int) -> list[torch.Tensor]:
        """Logits of each generated token of an open request (with ``keep_logits``)."""
        return self._requests[request].logits

    def close(self) -> None:
        """Stop the compute thread and close the store."""
        self._compute_thread.shutdown(wait=True)
        self.store.close()

    # -- the link ----------------------------------------------------------------------------------

    async def fetch(self, key: ExpertKey, slot: int) -> None:
        previous = self._slot_owner.get(slot)
        if previous is not None:
            self._slot_of.pop(previous, None)
        self._slot_owner[slot] = key
        await self.store.read_into(key.layer, key.expert, self.slots.slot(slot))
        self._slot_of[key] = slot

    # -- compute -----------------------------------------------------------------------------------

    async def compute(self, group: Group) -> Sequence[JobResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute_thread, self._compute, group)

    @torch.inference_mode()
    def _compute(self, group: Group) -> list[JobResult]:
        model, layer = self.model, group.layer
        states = [self._requests[job.request] for job in group.jobs]
        if layer == ENTRY_LAYER:
            tokens = [
                self._input_token(state, job.step) for state, job in zip(states, group.jobs, strict=True)
            ]
            hidden = model.embed(torch.tensor(tokens, dtype=torch.long, device=self.slots.device))
        else:
            carried = [_carried(state, job.request) for state, job in zip(states, group.jobs, strict=True)]
            hidden = torch.cat([c[0] for c in carried])
            ids = torch.cat([c[1] for c in carried])
            weights = torch.cat([c[2] for c in carried])
            experts = {
                e: self._slot_tensor(ExpertKey(layer, e)) for e in {int(i) for i in ids.flatten().tolist()}
            }
            hidden = model.moe(layer, hidden, ids, weights, experts)
        if layer == self.num_layers - 1:
            return self._sample(group, states, model.logits(hidden))
        following = layer + 1
        hidden = model.attention(following, hidden, [(state.cache, state.position, 1) for state in states])
        ids, weights = model.route(following, hidden)
        predicted = None
        if self.speculate and following + 1 < self.num_layers:
            predicted, _ = model.route(following + 1, hidden)
        results = []
        for row, (state, job) in enumerate(zip(states, group.jobs, strict=True)):
            state.hidden, state.ids, state.weights = (
                hidden[row : row + 1],
                ids[row : row + 1],
                weights[row : row + 1],
            )
            guess = tuple(sorted(set(predicted[row].tolist()))) if predicted is not None else ()
            results.append(JobResult(job, tuple(sorted(set(ids[row].tolist()))), guess))
        return results

    def _input_token(self, state: _RequestState, step: int) -> int:
        prompt = state.spec.prompt
        if step < len(prompt):
            return prompt[step]
        assert state.last_token is not None
        return state.last_token

    def _sample(self, group: Group, states: list[_RequestState], logits: torch.Tensor) -> list[JobResult]:
        results = []
        for row, (state, job) in enumerate(zip(states, group.jobs, strict=True)):
            state.position += 1
            state.hidden = state.ids = state.weights = None
            if job.step < state.spec.feed_steps:
                results.append(JobResult(job))  # a prompt token: nothing to sample
                continue
            row_logits = logits[row].float()
            if self.keep_logits:
                state.logits.append(row_logits.cpu())
            state.last_token = state.sampler.sample(row_logits)
            results.append(JobResult(job, token=state.last_token))
        return results

    def _slot_tensor(self, key: ExpertKey) -> torch.Tensor:
        slot = self._slot_of.get(key)
        if slot is None or self._slot_owner.get(slot) != key:
            raise RuntimeError(
                f"{key} is not resident in any cache slot; the runtime must pin it before compute"
            )
        tensor: torch.Tensor = self.slots.slot(slot)
        return tensor


def _carried(state: _RequestState, request: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual stream and routing a request's previous job left for this one."""
    if state.hidden is None or state.ids is None or state.weights is None:
        raise RuntimeError(f"request {request} has no hidden state for its MoE job: jobs ran out of order")
    return state.hidden, state.ids, state.weights
