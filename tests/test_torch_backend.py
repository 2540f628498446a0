"""Real models through the runtime: greedy tokens equal transformers' for every policy.

Tiny random models of each architecture are saved in the hub's format; the runtime runs several
requests at once with a cache far smaller than the model's experts, reading experts from the files
with O_DIRECT. Greedy tokens must equal ``transformers``' own ``generate`` for 32 tokens, and the
logits of every generated token must agree within 1e-4 (float32).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

import runahead.backends.torch as torch_backend
from runahead import mode
from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.models import qkernel
from runahead.models.base import DENSE_ROLES, MoEModel
from runahead.runtime import Runtime, RuntimeConfig
from runahead.sampling import SamplingParams

from modelhelpers import ARCHS, build_tiny_model, reference_logits
from simhelpers import POLICIES

TOKENS = 32
PROMPTS = [
    [5, 17, 42, 9],
    [3, 99, 7],
    [120, 4, 4, 66, 8, 31],
    [200],
    [11, 12, 13],
    [77, 78],
    [150, 9, 1],
    [6],
]


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """A saved tiny model and transformers' greedy continuations of every prompt."""
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    # The runtime does not stop at EOS here, so neither may the reference (min_new_tokens would
    # instead forbid EOS, changing the argmax wherever the model's greedy choice is EOS).
    reference.generation_config.eos_token_id = None
    expected = {}
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            out = reference.generate(  # an explicit mask: some configs make the bos id the pad id
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=TOKENS,
                do_sample=False,
            )
            expected[index] = out[0, len(prompt) :].tolist()
    return path, expected


def run(
    path: Path,
    policy: str,
    requests: int,
    *,
    slots: int,
    barrier: bool = True,
    store: str = "disk",
    chunk: int = 256,
):  # type: ignore[no-untyped-def]
    backend = TorchBackend.open(str(path), cache_slots=slots, store=store, keep_logits=True)
    runtime = Runtime(
        backend, RuntimeConfig(cache_slots=slots, policy=policy, step_barrier=barrier, prefill_chunk=chunk)
    )
    specs = [
        RequestSpec(i, TOKENS, prompt=tuple(PROMPTS[i]), sampling=SamplingParams(max_tokens=TOKENS))
        for i in range(requests)
    ]
    logits: dict[int, list[torch.Tensor]] = {}
    original_close = backend.close_request

    def keep(request: int) -> None:  # capture a request's logits before its state is freed
        if request in backend._requests:
            logits[request] = backend.logits_of(request)
        original_close(request)

    backend.close_request = keep  # type: ignore[method-assign]
    try:
        tokens = asyncio.run(runtime.run(specs))
    finally:
        backend.close()
    assert runtime.cache.is_idle()
    return tokens, logits, runtime


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_generates_transformers_tokens(model, policy: str) -> None:  # type: ignore[no-untyped-def]
    path, expected = model
    # 3 layers x 8 experts = 24; 8 slots hold 4 requests' top-2 at once: 8 requests need admission control
    tokens, _, runtime = run(path, policy, requests=8, slots=8)
    assert tokens == {i: expected[i] for i in range(8)}
    assert runtime.cache.stats.fetches > 0 and runtime.cache.stats.evictions > 0


def test_the_papers_grouping_generates_transformers_tokens(model) -> None:  # type: ignore[no-untyped-def]
    """Plain ``runahead`` holds groups back (bottleneck-aware grouping; the scheduler measures compute
    and reads: no cost model here) and runs in every policy test above; the paper's opportunistic
    grouping, by name, changes when jobs compute, never what: one architecture is enough."""
    path, expected = model
    if "qwen3_moe" not in str(path):
        pytest.skip("one architecture covers the scheduling change")
    tokens, _, runtime = run(path, "runahead/grouping=opportunistic", requests=8, slots=8)
    assert tokens == {i: expected[i] for i in range(8)}
    assert runtime.cache.stats.fetches > 0


def test_the_speculative_gate_runs_only_for_policies_that_prefetch_by_it(model) -> None:  # type: ignore[no-untyped-def]
    """The next layer's gate costs a norm, a router product and a top-k per job: a policy without
    the gate predictor must not pay for it, one with it must get its guesses (prefetches)."""
    path, expected = model
    if "qwen3_moe" not in str(path):
        pytest.skip("the runtime's switch is the same for every architecture")
    calls: dict[str, list[int]] = {}
    original = MoEModel.route

    def counted(
        self: MoEModel, layer: int, hidden: torch.Tensor, normed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls[policy].append(layer)
        return original(self, layer, hidden, normed)

    for policy in ("sync", "prefetch-gate"):
        calls[policy] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(MoEModel, "route", counted)
            tokens, _, runtime = run(path, policy, requests=2, slots=8)
        assert tokens == {i: expected[i] for i in range(2)}
        assert runtime.backend.speculate == (policy == "prefetch-gate")
        prefetches = runtime.cache.stats.prefetches
        assert prefetches > 0 if policy == "prefetch-gate" else prefetches == 0
    # sync routes each token once per layer; the gate predictor also routes one layer ahead
    assert len(calls["prefetch-gate"]) > len(calls["sync"])


def test_logits_agree_with_transformers(model) -> None:  # type: ignore[no-untyped-def]
    """Within float32 noise of transformers' logits. Runahead groups by measured timing, so the rows
    a product sees, and with them its rounding, change from run to run: over 8 runs the largest
    difference of Qwen3.5-MoE (recurrent state carried over 32 tokens, logits up to 3.4) ranged
    6e-5 to 1.1e-4 with the same code; a wrong expert or weight is off by 1e-2 and more."""
    path, expected = model
    _, logits, _ = run(path, "runahead", requests=3, slots=12, barrier=False)
    for request in range(3):
        sequence = PROMPTS[request] + expected[request]
        ref = reference_logits(path, sequence)[len(PROMPTS[request]) - 1 : -1]
        ours = torch.stack(logits[request])
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 2e-4


@pytest.mark.parametrize("requests", [1, 2, 5])
def test_single_and_few_requests_from_host_memory(model, requests: int) -> None:  # type: ignore[no-untyped-def]
    path, expected = model
    tokens, _, _ = run(path, "runahead", requests=requests, slots=4, store="host")
    assert tokens == {i: expected[i] for i in range(requests)}


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_prompts_in_chunks_and_waves_give_the_same_tokens(model, chunk: int) -> None:  # type: ignore[no-untyped-def]
    path, expected = model
    # prompts of 1-6 tokens in chunks of `chunk`: a chunk's experts exceed top-2, so its MoE runs in waves
    tokens, _, runtime = run(path, "runahead", requests=8, slots=6, barrier=False, chunk=chunk)
    assert tokens == {i: expected[i] for i in range(8)}
    assert max(record.size for record in runtime.recorder.computes) >= 2


@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "no-barrier"])
def test_switching_between_running_ahead_and_batching_changes_no_token(  # type: ignore[no-untyped-def]
    model, barrier: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive grouping (plain ``runahead`` on a measuring backend) with one-step windows switches
    between the bottleneck rule and one group of every request every few steps, mid-layer without
    the step barrier: the tokens stay transformers'."""
    path, expected = model
    if "qwen3_moe" not in str(path):
        pytest.skip("one architecture covers the scheduling change")
    for name in ("PROBE_STEPS", "FIRST_EXPLOIT_STEPS", "MAX_EXPLOIT_STEPS"):
        monkeypatch.setattr(mode, name, 1)
    tokens, _, runtime = run(path, "runahead", requests=4, slots=8, barrier=barrier)
    assert tokens == {i: expected[i] for i in range(4)}
    recorder = runtime.recorder
    assert recorder.mode_switches >= 4
    assert 0 < recorder.batched_tokens < recorder.token_count


SCHEDULES = ("sync", "runahead", "runahead/grouping=opportunistic", "runahead/grouping=static:1:1:1:1:1")


def logits_under_every_schedule(path: Path, chunk: int, **options: Any) -> dict[str, dict[int, torch.Tensor]]:
    """Each request's logits of every step, per policy (5 requests, 10 cache slots)."""
    seen = {}
    for policy in SCHEDULES:
        backend = TorchBackend.open(str(path), cache_slots=10, keep_logits=True, **options)
        runtime = Runtime(backend, RuntimeConfig(cache_slots=10, policy=policy, prefill_chunk=chunk))
        specs = [
            RequestSpec(i, 12, prompt=tuple(PROMPTS[i]), sampling=SamplingParams(max_tokens=12))
            for i in range(5)
        ]
        logits: dict[int, torch.Tensor] = {}
        original_close = backend.close_request

        def keep(request: int, backend=backend, original_close=original_close, logits=logits) -> None:  # type: ignore[no-untyped-def]
            if request in backend._requests:
                logits[request] = torch.stack(backend.logits_of(request))
            original_close(request)

        backend.close_request = keep  # type: ignore[method-assign]
        waves = []
        sums_with_waves = torch_backend.sums_with_waves

        def counted(*args, sums_with_waves=sums_with_waves, waves=waves):  # type: ignore[no-untyped-def]
            waves.append(args[-1])
            return sums_with_waves(*args)

        torch_backend.sums_with_waves = counted  # type: ignore[assignment]
        try:
            asyncio.run(runtime.run(specs))
            assert bool(waves) == (chunk > 1)  # a prompt chunk routes more experts than a job may pin
        finally:
            torch_backend.sums_with_waves = sums_with_waves  # type: ignore[assignment]
            backend.close()
        seen[policy] = logits
    return seen


def assert_bit_identical(seen: dict[str, dict[int, torch.Tensor]]) -> None:
    first, *others = seen.values()
    for other in others:
        for request in range(5):
            assert torch.equal(first[request], other[request])  # bit for bit, not just close


@pytest.mark.parametrize("chunk", [1, 4])
def test_batch_invariant_mode_gives_bit_identical_logits_under_every_schedule(model, chunk: int) -> None:  # type: ignore[no-untyped-def]
    """Also where prompt chunks run their MoE in waves, which the cache splits differently under each
    schedule: a waved job's products are summed at its last wave in one wave's order."""
    path, _ = model
    assert_bit_identical(logits_under_every_schedule(path, chunk, batch_invariant=True))


@pytest.mark.skipif(not qkernel.available(), reason="no C compiler here")
@pytest.mark.parametrize(
    ("stored", "compute"),
    [(torch.bfloat16, "float32"), (torch.float32, "float32"), (torch.bfloat16, "bfloat16")],
    ids=["bf16", "f32", "bf16-compute"],
)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "gemma4"])
def test_a_checkpoint_on_the_kernel_gives_bit_identical_logits_under_every_schedule(
    arch: str, stored: torch.dtype, compute: str, tmp_path: Path
) -> None:
    """On a float32 CPU a bf16 checkpoint's experts, projections, routers, shared experts and dense
    MLPs go through the stored-weight kernel, and a float32 checkpoint's through its float32 pass,
    whose rows never depend on the rows beside them; in a bfloat16 compute the bf16 matrices take the
    kernel's bf16 pass at decode's rows (widened rows, one rounding: ``half_product``). Qwen3.6's
    batched delta rule pads its narrow elementwise rows (``_rowwise``): the default mode, groups
    batched as each schedule likes, waves included."""
    widths = {  # every resident matrix's rows whole 32-weight blocks, as the kernel takes them
        "qwen3_moe": {},
        "qwen3_5_moe": {"linear_value_head_dim": 8, "shared_expert_intermediate_size": 32},
        "gemma4": {"hidden_size": 64, "head_dim": 8, "intermediate_size": 32},
    }[arch]
    path = build_tiny_model(arch, tmp_path / arch, dtype=stored, moe_intermediate_size=32, **widths)
    backend = TorchBackend.open(str(path), cache_slots=10, dtype=compute)
    model = backend.model
    dense = {k: w.dtype for k, w in model.weights.items() if k.rpartition(".")[2] in DENSE_ROLES}
    width = model.config.hidden_size
    kinds = {model._dense_kind(k, w) for k, w in model.weights.items() if k in dense and w.shape[-1] == width}
    backend.close()
    assert set(dense.values()) == {stored}, dense
    assert kinds == {"BF16" if stored == torch.bfloat16 else qkernel.FLOAT32}, kinds
    assert_bit_identical(logits_under_every_schedule(path, 4, dtype=compute))


def test_host_routing_gives_the_rows_found_on_the_device(model) -> None:  # type: ignore[no-untyped-def]
    """The MoE takes each expert's rows from the routing read back to the host (no device read).
    In every group, waves and several requests included, those rows equal the ones ``torch.where``
    finds in the wave-masked ids as a tensor, in the same order, and the tokens stay
    transformers'."""
    path, expected = model
    backend = TorchBackend.open(str(path), cache_slots=6)
    checked = []
    routing = backend._routing

    def compare(jobs, states, wanted):  # type: ignore[no-untyped-def]
        ours = routing(jobs, states, wanted)
        masked = []
        for state, job in zip(states, jobs, strict=True):
            wave = torch.tensor(sorted(wanted if not job.remaining and job.wave == 0 else job.experts))
            ids = torch.tensor(state.routing)
            masked.append(torch.where(torch.isin(ids, wave), ids, -1))
        ids = torch.cat(masked)
        found = [e for e in sorted(wanted) if bool((ids == e).any())]
        assert [e for e, _, _ in ours.spans] == found
        for e, start, stop in ours.spans:
            rows, kpos = torch.where(ids == e)
            assert torch.equal(ours.rows[start:stop], rows) and torch.equal(ours.kpos[start:stop], kpos)
        checked.append((len(jobs), any(job.remaining or job.wave for job in jobs)))
        return ours

    backend._routing = compare  # type: ignore[method-assign]
    runtime = Runtime(backend, RuntimeConfig(cache_slots=6, policy="runahead", prefill_chunk=2))
    params = SamplingParams(max_tokens=8)
    specs = [RequestSpec(i, 8, prompt=tuple(PROMPTS[i]), sampling=params) for i in range(4)]
    try:
        tokens = asyncio.run(runtime.run(specs))
    finally:
        backend.close()
    assert tokens == {i: expected[i][:8] for i in range(4)}
    assert any(size >= 2 for size, _ in checked) and any(waves for _, waves in checked)
