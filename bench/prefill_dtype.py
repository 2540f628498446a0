"""Time to a prompt's first token in each compute dtype: what float32 with stored experts costs prompts.

One request, every expert cached (host store), the medium model by default: a short prompt first
(its experts fill the cache), then a ``--prompt-tokens`` prompt to its first token, ``--rounds``
times per dtype, each dtype in its own backend (one process, one after the other).

    python bench/prefill_dtype.py [--model PATH] [--dtypes float32,bfloat16] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from runahead.backends.torch import TorchBackend
from runahead.jobs import RequestSpec
from runahead.medium import medium_model
from runahead.runtime import Runtime, RuntimeConfig

WARM_TOKENS = 64


def first_token_seconds(backend: TorchBackend, prompt: tuple[int, ...]) -> float:
    """Seconds from submitting ``prompt`` to its first token, after a short prompt warmed the cache."""

    async def go() -> float:
        runtime = Runtime(backend, RuntimeConfig(cache_slots=backend.num_slots, policy="sync"))
        await runtime.run([RequestSpec(0, 1, prompt=prompt[:WARM_TOKENS])])
        start = time.perf_counter()
        await runtime.run([RequestSpec(1, 1, prompt=prompt)])
        return time.perf_counter() - start

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a model folder (default: the medium model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = args.model or str(medium_model())
    prompt = tuple(range(3, 3 + args.prompt_tokens))
    for dtype in args.dtypes.split(","):
        backend = TorchBackend.open(path, cache_fraction=1.0, dtype=dtype, store="host")
        try:
            times = [first_token_seconds(backend, prompt) for _ in range(args.rounds)]
        finally:
            backend.close()
        print(
            f"{dtype:>9} ({backend.compute_threads} threads): {args.prompt_tokens}-token prompt to its "
            f"first token " + ", ".join(f"{t:.2f} s" for t in times),
            flush=True,
        )


if __name__ == "__main__":
    main()
