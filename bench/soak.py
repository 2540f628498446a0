"""Soak: many concurrent streams against a real ``runahead serve`` process for minutes.

Clients send greedy completions of prompts from a fixed pool (random lengths), streamed or whole,
and a share of them hang up mid-answer. The script checks every completed answer against
transformers' greedy tokens for that prompt, samples the server's resident memory, and at the end
reads ``/metrics``: requests still active and expert slots still pinned must be back to 0. An
answer that leaves the reference where transformers' own two likeliest tokens were within
:data:`NEAR_TIE` of each other is counted apart (float32 rounding depends on the batch there).

::

    python bench/soak.py --minutes 10 --clients 64 --out bench/results/soak   # the full run
    python bench/soak.py --minutes 1 --clients 16 --model path/to/model      # a short one

The result (JSON, and a line per field on stdout) says: requests served, by outcome; errors;
mismatches against the reference; RSS at start, after warm-up and at the end, and its growth
after warm-up; the final active requests and pinned slots.

The server computes in float32 (``--dtype float32``), the reference's dtype: ``auto`` takes bfloat16
on a CPU where that is faster (the small model on a Zen 4 EPYC, 2026-12-06), and a bfloat16 answer
leaves float32's greedy text within a few tokens (1646 of 1753 answers did in a 4-minute run there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

MAX_TOKENS = 24
POOL = 24


@dataclass
class SoakResult:
    seconds: float
    clients: int
    completed: int = 0
    dropped: int = 0  # clients that hung up mid-answer, on purpose
    errors: int = 0  # answers that were neither complete nor dropped
    mismatches: int = 0  # completed answers whose text differs from the reference
    near_ties: int = 0  # of those, ones that leave it where its greedy choice was a near tie
    error_samples: list[str] = field(default_factory=list)
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    rss_growth_after_warmup: float = 0.0
    final_active: float = -1.0
    final_pinned: float = -1.0
    server_errors: int = 0  # tracebacks and error lines in the server's log

    def ok(self) -> bool:
        return (
            self.errors == 0
            and self.server_errors == 0
            and self.mismatches == self.near_ties
            and self.completed > 0
            and self.final_active == 0
            and self.final_pinned == 0
        )


NEAR_TIE = 1e-3
"""A reference step whose two likeliest logits are closer than this is a near tie: float32 rounding,
which depends on what a request is batched with, may pick either (see ``batch_invariant``)."""


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]  # transformers' greedy continuation of each prompt
    margins: list[list[float]]  # its top-1 minus top-2 logit at each generated step
    tokenizer: Any


def reference_pool(model: str, seed: int) -> Reference:
    """Prompts of random token ids, transformers' greedy tokens for each (up to MAX_TOKENS), and
    how close each greedy choice was."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager")
    rng = random.Random(seed)
    vocab = reference.config.vocab_size
    eos = tokenizer.eos_token_id
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 24))] for _ in range(POOL)]
    tokens, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
            )
            tokens.append(out[0, len(prompt) :].tolist())
            top2 = reference(out).logits[0, len(prompt) - 1 : -1].topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return Reference(prompts, tokens, margins, tokenizer)


def near_tie(reference: Reference, prompt: int, got: str) -> bool:
    """Whether ``got`` leaves the reference at a step whose greedy choice was a near tie."""
    tokens, decode = reference.tokens[prompt], reference.tokenizer.decode
    step = 0
    while step < len(tokens) and got.startswith(decode(tokens[: step + 1], skip_special_tokens=True)):
        step += 1
    return step < len(tokens) and reference.margins[prompt][step] < NEAR_TIE


def expected_text(tokenizer: Any, tokens: list[int], max_tokens: int) -> str:
    """What the server should answer: the reference cut at ``max_tokens`` or at the end-of-sequence."""
    cut = tokens[:max_tokens]
    if tokenizer.eos_token_id in cut:
        cut = cut[: cut.index(tokenizer.eos_token_id) + 1]
    return str(tokenizer.decode(cut, skip_special_tokens=True))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def client(
    url: str,
    number: int,
    deadline: float,
    reference: Reference,
    drop: float,
    result: SoakResult,
) -> None:
    rng = random.Random(number)
    prompts, tokens, tokenizer = reference.prompts, reference.tokens, reference.tokenizer
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            i = rng.randrange(len(prompts))
            max_tokens = rng.randint(1, MAX_TOKENS)
            stream = rng.random() < 0.5
            hang_up = rng.random() < drop
            body = {"model": "soak", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0}
            want = expected_text(tokenizer, tokens[i], max_tokens)
            try:
                if stream:
                    text = await _streamed(http, {**body, "stream": True}, rng, hang_up)
                elif hang_up:
                    task = asyncio.ensure_future(http.post("/v1/completions", json=body))
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    task.cancel()  # the connection closes: the server cancels the request
                    await asyncio.gather(task, return_exceptions=True)
                    text = None
                else:
                    answer = await http.post("/v1/completions", json=body)
                    if answer.status_code != 200:
                        raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")
                    text = answer.json()["choices"][0]["text"]
            except Exception as error:  # every failure is counted and sampled
                result.errors += 1
                if len(result.error_samples) < 10:
                    result.error_samples.append(repr(error)[:300])
                continue
            if text is None:
                result.dropped += 1
            elif text == want:
                result.completed += 1
            else:
                result.completed += 1
                result.mismatches += 1
                if near_tie(reference, i, text):
                    result.near_ties += 1
                elif len(result.error_samples) < 10:
                    result.error_samples.append(f"mismatch on prompt {i}: {text!r} != {want!r}")


async def _streamed(
    http: httpx.AsyncClient, body: dict[str, Any], rng: random.Random, hang_up: bool
) -> str | None:
    """The streamed text, or None when this client hangs up after a few events."""
    leave_after = rng.randint(1, 4) if hang_up else -1
    pieces: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}")
        events = 0
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return "".join(pieces)
            payload = json.loads(data)
            if "error" in payload:
                raise RuntimeError(f"stream error: {payload['error']}")
            pieces.append(payload["choices"][0]["text"])
            events += 1
            if events == leave_after:
                return None  # leaving the block closes the connection mid-stream
    raise RuntimeError("the stream ended without [DONE]")


async def soak(
    url: str, pid: int, seconds: float, clients: int, drop: float, reference: Reference
) -> SoakResult:
    result = SoakResult(seconds=seconds, clients=clients)
    start = time.monotonic()
    deadline = start + seconds

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            result.rss_mib.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
            await asyncio.sleep(max(0.5, seconds / 60))

    sampler = asyncio.ensure_future(sample_memory())
    await asyncio.gather(*(client(url, n, deadline, reference, drop, result) for n in range(clients)))
    sampler.cancel()
    result.rss_mib.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
    warm = [mib for t, mib in result.rss_mib if t >= seconds * 0.2] or [result.rss_mib[-1][1]]
    result.rss_growth_after_warmup = round((result.rss_mib[-1][1] - warm[0]) / warm[0], 4)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for _ in range(100):  # the last cancellations settle within moments
            try:
                text = (await http.get("/metrics")).text
            except httpx.TimeoutException:  # a loaded machine: ask again, and say so
                result.error_samples.append("/metrics did not answer within 120 s")
                continue
            result.final_active = metric(text, "runahead_engine_requests_active")
            result.final_pinned = metric(text, "runahead_engine_cache_slots_pinned")
            if result.final_active == 0 and result.final_pinned == 0:
                break
            await asyncio.sleep(0.1)
    return result


def run(
    model: str, minutes: float, clients: int, drop: float, seed: int, cache_fraction: float
) -> SoakResult:
    """Start a server process on ``model``, soak it, stop it; return the result."""
    reference = reference_pool(model, seed)
    port = free_port()
    command = [sys.executable, "-m", "runahead.cli", "serve", model, "--port", str(port)]
    command += ["--model-name", "soak", "--cache-fraction", str(cache_fraction), "--log-level", "warning"]
    command += ["--dtype", "float32"]  # the reference's: see the module's docstring
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below) - a pipe nobody reads blocks the server
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 120 s")
            time.sleep(0.1)
        result = asyncio.run(soak(url, server.pid, minutes * 60, clients, drop, reference))
        log.seek(0)
        result.server_errors = sum("Traceback" in line or "[error" in line for line in log)
        return result
    finally:
        log.close()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a model folder, or 'small' (built once)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--drop", type=float, default=0.2, help="share of requests whose client hangs up")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for soak.json")
    args = parser.parse_args(argv)
    from runahead.torchbench import resolve_model

    model = resolve_model(args.model)
    result = run(model, args.minutes, args.clients, args.drop, args.seed, args.cache_fraction)
    report = asdict(result)
    report.update(model=args.model, cpu=os.cpu_count(), ok=result.ok())
    for name, value in report.items():
        if name != "rss_mib":
            print(f"{name}: {value}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    return 0 if result.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
