"""The mlx backend from the command line and over HTTP: ``generate``, ``bench`` and ``serve``
with ``--backend mlx`` give mlx-lm's greedy tokens (a 4-bit mlx-lm folder). Skipped without MLX."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from runahead.cli import main

from mlxhelpers import build_mlx_model, convert, mlx_lm_greedy
from serverhelpers import running_server

PROMPT = [5, 17, 42, 9]
TOKENS = 8


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    root = tmp_path_factory.mktemp("mlx-cli")
    path = convert(build_mlx_model("qwen3_moe", root / "f32", quantized=True), root / "q4")
    return path, mlx_lm_greedy(path, [PROMPT], TOKENS)[0]


def test_generate_with_the_mlx_backend(
    q4: tuple[Path, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = q4
    argv = ["generate", str(path), "--backend", "mlx", "--prompt-ids", ",".join(map(str, PROMPT))]
    assert (
        main([*argv, "--max-tokens", str(TOKENS), "--concurrency", "4", "--json", "--cache-fraction", "0.34"])
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    eos = 2  # generate stops at the model's end-of-sequence token; mlx-lm's generate_step does not
    want = expected[: expected.index(eos) + 1] if eos in expected else expected
    assert [row["token_ids"] for row in rows] == [want] * 4


def test_bench_with_the_mlx_backend_writes_rows(q4: tuple[Path, list[int]], tmp_path: Path) -> None:
    path, _ = q4
    argv = ["bench", "--backend", "mlx", "--model", str(path), "--policy", "sync,runahead"]
    argv += ["--concurrency", "4", "--cache-fraction", "0.34", "--steps", "4", "--warmup-steps", "1"]
    assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["backend"] for row in rows] == ["mlx", "mlx"]
    assert [row["compute_dtype"] for row in rows] == ["float32", "float32"]  # auto on MLX's CPU device
    assert all(row["tokens"] == 16 and row["fetch_s"] > 0 and row["compute_s"] > 0 for row in rows)
    assert rows[0]["token_digest"] == rows[1]["token_digest"]  # the same tokens under both policies


def test_serve_with_the_mlx_backend_answers_a_real_client(q4: tuple[Path, list[int]]) -> None:
    import openai

    path, expected = q4
    with running_server(path, backend="mlx", device="cpu", cache_fraction=0.34) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        assert server.wait_until_quiet()
    eos = 2
    want = expected[: expected.index(eos)] if eos in expected else expected
    assert done.usage is not None and done.usage.completion_tokens == len(want) + (eos in expected)
    assert done.choices[0].text == " ".join(f"w{t - 3}" for t in want)
