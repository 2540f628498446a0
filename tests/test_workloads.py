"""Workloads: the synthetic distributions' statistics, determinism, arrivals, and the file loaders."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runahead.bench import BenchPoint
from runahead.bench_requests import AGENTIC_MAX_PREFILL, request_specs
from runahead.cli import main
from runahead.jobs import RequestSpec
from runahead.workload_files import (
    WorkloadFileError,
    estimate_tokens,
    load_sharegpt,
    load_swe_agent,
    load_trajectories,
)
from runahead.workloads import (
    AGENTIC,
    AGENTIC_MEDIAN_PROMPT_RANGE,
    CHAT,
    WORKLOADS,
    AgenticWorkload,
    RequestSample,
    get_workload,
    sample_requests,
    summary,
    to_request_specs,
)

N = 5000


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_chat_matches_sharegpt_means(seed: int) -> None:
    stats = summary(sample_requests("chat", N, seed))
    assert stats["n"] == N
    assert stats["prompt_mean"] == pytest.approx(161, rel=0.10)
    assert stats["output_mean"] == pytest.approx(338, rel=0.10)
    # Long right tail: the median sits well below the mean, p90 well above it.
    assert stats["prompt_median"] < 0.75 * stats["prompt_mean"] < stats["prompt_p90"] / 2


def test_chat_lengths_stay_in_clip_range() -> None:
    samples = sample_requests(CHAT, N, 3)
    for s in samples:
        assert CHAT.min_tokens <= s.prompt_tokens <= CHAT.max_tokens
        assert CHAT.min_tokens <= s.output_tokens <= CHAT.max_tokens


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_agentic_long_prompts_short_outputs(seed: int) -> None:
    samples = sample_requests("agentic", N, seed)
    stats = summary(samples)
    low, high = AGENTIC_MEDIAN_PROMPT_RANGE
    assert low <= stats["prompt_median"] <= high
    assert 100 <= stats["output_mean"] <= 200
    assert stats["output_p90"] < 1000
    assert all(s.prompt_tokens + s.output_tokens <= AGENTIC.context_tokens for s in samples)
    assert all(s.output_tokens >= 1 and s.prompt_tokens >= 1 for s in samples)


def test_agentic_prompts_grow_with_trajectory_length() -> None:
    short = summary(sample_requests(AgenticWorkload(median_turns=5, max_turns=10), N, 0))
    long = summary(sample_requests(AgenticWorkload(median_turns=20, max_turns=40), N, 0))
    assert short["prompt_median"] < long["prompt_median"]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_samples(name: str) -> None:
    assert sample_requests(name, 200, 5) == sample_requests(name, 200, 5)
    assert sample_requests(name, 200, 5) != sample_requests(name, 200, 6)
    poisson = sample_requests(name, 200, 5, arrival="poisson", rate=2.0)
    assert poisson == sample_requests(name, 200, 5, arrival="poisson", rate=2.0)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_prefix_stable_and_lengths_independent_of_arrivals(name: str) -> None:
    many = sample_requests(name, 100, 11)
    assert sample_requests(name, 40, 11) == many[:40]
    timed = sample_requests(name, 100, 11, arrival="poisson", rate=3.0)
    assert [(s.prompt_tokens, s.output_tokens) for s in timed] == [
        (s.prompt_tokens, s.output_tokens) for s in many
    ]


def test_closed_arrivals_are_none() -> None:
    assert all(s.arrival_s is None for s in sample_requests("chat", 50, 0))


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_poisson_arrivals(rate: float) -> None:
    samples = sample_requests("chat", N, 2, arrival="poisson", rate=rate)
    times = np.array([s.arrival_s for s in samples], dtype=float)
    assert np.all(np.diff(times) >= 0) and times[0] > 0
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.10)
    assert summary(samples)["mean_interarrival_s"] == pytest.approx(1 / rate, rel=0.10)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        sample_requests("nope", 1, 0)
    with pytest.raises(ValueError, match="rate"):
        sample_requests("chat", 1, 0, arrival="poisson")
    with pytest.raises(ValueError, match="rate"):
        sample_requests("chat", 1, 0, arrival="poisson", rate=0.0)
    with pytest.raises(ValueError, match="closed loop"):
        sample_requests("chat", 1, 0, rate=1.0)
    with pytest.raises(ValueError, match="arrival"):
        sample_requests("chat", 1, 0, arrival="bursty")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no samples"):
        summary([])
    assert sample_requests("chat", 0, 0) == []
    assert get_workload(CHAT) is CHAT and get_workload("agentic") is AGENTIC


def test_to_request_specs() -> None:
    samples = sample_requests("agentic", 5, 0)
    specs = to_request_specs(samples, start_id=10)
    assert all(isinstance(spec, RequestSpec) for spec in specs)
    assert [spec.request for spec in specs] == list(range(10, 15))
    assert [(spec.max_tokens, spec.prompt_tokens) for spec in specs] == [
        (s.output_tokens, s.prompt_tokens) for s in samples
    ]


def test_estimate_tokens() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("a b c d e") == 5  # words beat 9 chars / 4
    assert estimate_tokens("x" * 40) == 10  # one long "word": chars / 4


# --------------------------------------------------------------------------------------------------
# Loaders


class WordTokenizer:
    """One token per whitespace-separated word (a stand-in for a real tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return [0] * len(text.split())


def _words(n: int) -> str:
    return " ".join(["w"] * n)


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_load_sharegpt(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "sharegpt.json",
        [
            {
                "id": "a",
                "conversations": [
                    {"from": "human", "value": _words(10)},
                    {"from": "gpt", "value": _words(30)},
                    {"from": "human", "value": _words(5)},
                    {"from": "gpt", "value": _words(7)},
                ],
            },
            {"id": "bad", "conversations": [{"from": "human"}, {"from": "gpt", "value": 3}]},
            {
                "id": "c",
                "conversations": [
                    {"from": "system", "value": _words(4)},
                    {"from": "human", "value": _words(12)},
                    {"from": "gpt", "value": _words(20)},
                    {"from": "human", "value": _words(2)},  # no reply: no request
                ],
            },
        ],
    )
    samples = load_sharegpt(path, tokenizer=WordTokenizer())
    assert samples == [RequestSample(10, 30), RequestSample(5, 7), RequestSample(12, 20)]
    assert samples.skipped == 1 and samples.path == path
    assert all(s.arrival_s is None for s in samples)

    history = load_sharegpt(path, tokenizer=WordTokenizer(), with_history=True)
    assert [s.prompt_tokens for s in history] == [10, 10 + 30 + 5, 4 + 12]
    assert load_sharegpt(path, tokenizer=WordTokenizer(), limit=2) == samples[:2]
    estimated = load_sharegpt(path)  # no tokenizer: "w w w" is one token per word
    assert [(s.prompt_tokens, s.output_tokens) for s in estimated] == [(10, 30), (5, 7), (12, 20)]


def test_load_swe_agent_history(tmp_path: Path) -> None:
    history = [
        {"role": "system", "content": _words(100)},
        {"role": "user", "content": [{"type": "text", "text": _words(50)}]},
    ]
    for turn in range(4):
        history.append({"role": "assistant", "content": _words(10 + turn)})
        history.append({"role": "user", "content": _words(200)})
    history.insert(3, {"role": "user", "content": 42})  # malformed: skipped
    path = _write(tmp_path / "run.traj", {"history": history, "trajectory": [], "info": {}})
    samples = load_swe_agent(path, tokenizer=WordTokenizer())
    assert len(samples) == 4 and samples.skipped == 1
    assert [s.output_tokens for s in samples] == [10, 11, 12, 13]
    prompts = [s.prompt_tokens for s in samples]
    assert prompts == [150, 150 + 10 + 200, 360 + 11 + 200, 571 + 12 + 200]
    assert all(a < b for a, b in itertools.pairwise(prompts))
    assert load_swe_agent(path, tokenizer=WordTokenizer(), limit=2) == samples[:2]


def test_load_swe_agent_trajectory_only(tmp_path: Path) -> None:
    steps = [
        {"thought": _words(5), "action": _words(3), "observation": _words(100)},
        {"response": _words(20), "thought": "x", "action": "y", "observation": _words(50)},
        "not a step",
        {"response": _words(9), "observation": None},
        {"response": _words(4), "observation": _words(1)},
    ]
    path = _write(tmp_path / "traj.json", {"trajectory": steps})
    samples = load_swe_agent(path, tokenizer=WordTokenizer(), system_tokens=1000)
    assert samples.skipped == 1
    assert [(s.prompt_tokens, s.output_tokens) for s in samples] == [
        (1000, 8),
        (1108, 20),
        (1178, 9),
        (1187, 4),
    ]


@pytest.mark.parametrize("loader", [load_sharegpt, load_swe_agent])
def test_loader_errors_name_the_file(tmp_path: Path, loader: Callable[[Path], list[RequestSample]]) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(WorkloadFileError, match=r"missing\.json.*does not exist"):
        loader(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadFileError, match=r"bad\.json.*not valid JSON"):
        loader(bad)
    wrong = _write(tmp_path / "wrong.json", {"a": 1} if loader is load_sharegpt else [1, 2])
    with pytest.raises(WorkloadFileError, match=r"wrong\.json"):
        loader(wrong)


def test_swe_agent_without_turns_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "empty.traj", {"info": {}})
    with pytest.raises(WorkloadFileError, match=r"empty\.traj.*'history' or 'trajectory'"):
        load_swe_agent(path)


def _trajectory(path: Path, outputs: list[int], observation: int) -> Path:
    history: list[dict[str, object]] = [{"role": "system", "content": _words(100)}]
    for output in outputs:
        history.append({"role": "assistant", "content": _words(output)})
        history.append({"role": "user", "content": _words(observation)})
    return _write(path, {"history": history})


def test_load_trajectories_reads_a_folder_and_skips_a_bad_file(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    _trajectory(tmp_path / "b" / "b.traj", [3, 4], 50)
    _trajectory(tmp_path / "a.traj", [10, 20, 30], 200)
    (tmp_path / "broken.traj").write_text("{not json")
    (tmp_path / "notes.json").write_text("ignored: not a .traj")
    turns = load_trajectories(tmp_path)  # estimated tokens: one per "w"
    assert [(t.sample.prompt_tokens, t.sample.output_tokens, t.new_tokens) for t in turns] == [
        (100, 10, 100),  # a.traj (sorted first): the first turn prefills its whole prompt
        (100 + 10 + 200, 20, 10 + 200),  # then the previous output and the observation
        (310 + 20 + 200, 30, 20 + 200),
        (100, 3, 100),  # b/b.traj: a new trajectory starts from its whole prompt
        (100 + 3 + 50, 4, 3 + 50),
    ]
    with pytest.raises(WorkloadFileError, match=r"broken\.traj.*not valid JSON"):
        load_trajectories(tmp_path / "broken.traj")  # a single bad file is an error
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkloadFileError, match=r"empty holds no SWE-agent trajectory"):
        load_trajectories(tmp_path / "empty")


def test_bench_requests_come_from_the_files(tmp_path: Path) -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": _words(n)}, {"from": "gpt", "value": _words(5)}]}
        for n in (11, 12, 13)
    ]
    sharegpt = _write(tmp_path / "sharegpt.json", conversations)
    chat = BenchPoint("qwen3.6-35b-a3b", "thor", "sync", 2, 0.3, 4, workload_file=str(sharegpt))
    assert [(s.prompt_tokens, s.max_tokens) for s in request_specs(chat)] == [(11 + 8, 4), (12 + 8, 4)]
    seeded = replace(chat, seed=1)  # starts concurrency * seed requests in, wrapping around
    assert [s.prompt_tokens - 8 for s in request_specs(seeded)] == [13, 11]

    _trajectory(tmp_path / "run.traj", [3, 9, 2], 6000)
    agentic = replace(chat, workload="agentic", workload_file=str(tmp_path / "run.traj"), steps=4)
    specs = request_specs(agentic)  # budget: 2 lanes x 4 tokens
    assert [(s.prompt_tokens, s.prefill_tokens, s.max_tokens) for s in specs] == [
        (8, 100, 3),  # first turn: the whole prompt is new
        (100 + 3 + 6000 - AGENTIC_MAX_PREFILL + 8, AGENTIC_MAX_PREFILL, 4),  # new tokens capped
        (6103 + 9 + 6000 - AGENTIC_MAX_PREFILL + 8, AGENTIC_MAX_PREFILL, 1),  # cut to the budget
    ]


def test_bench_runs_a_workload_file_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": _words(n)}, {"from": "gpt", "value": _words(5)}]}
        for n in (40, 400)
    ]
    path = _write(tmp_path / "sharegpt.json", conversations)
    argv = ["bench", "--workload-file", str(path), "--policy", "sync,runahead", "--concurrency", "2"]
    assert main([*argv, "--steps", "3", "--quiet", "--out", str(tmp_path / "out")]) == 0
    assert "chat workload: 2 requests from" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [row["policy"] for row in rows] == ["sync", "runahead"]
    assert all(row["workload_file"] == str(path) and row["tokens_per_s"] > 0 for row in rows)
