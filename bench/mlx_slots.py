"""How to write one expert into MLX slot memory without copying the pool (issue 9, item 2).

    python bench/mlx_slots.py

Times, for one expert matrix of ``512 x 1024`` float32 (and 4-bit packed) in pools of 64 and 512 slots:

- ``pool[s] = expert`` (a slice update of one ``[S, I, H]`` array, evaluated): what the mlx backend
  does (:mod:`runahead.models.mlx.slots`), on the compute thread between groups;
- the same while a pending (unevaluated) computation still reads the pool: MLX must then copy the
  whole pool, which is why the backend never writes a slot while a group's graph is pending;
- the alternative, a list of per-slot arrays stacked into ``[k, I, H]`` for a group's ``k`` experts
  (``mx.stack``), per group rather than per write.
"""

from __future__ import annotations

import time

import mlx.core as mx

ROWS, COLS, REPEATS = 512, 1024, 10


def timed(fn, repeats: int = REPEATS) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(slots: int, expert: mx.array) -> str:
    """One line of timings for a pool of ``slots`` slots."""
    pool = mx.zeros((slots, ROWS, COLS))
    mx.eval(pool)
    state = {"i": 0}

    def write() -> None:
        state["i"] = (state["i"] + 1) % slots
        pool[state["i"]] = expert
        mx.eval(pool)

    def write_while_read() -> None:
        pending = pool[0].sum()  # a graph that still reads the pool's current buffer
        pool[1] = expert
        mx.eval(pool)
        mx.eval(pending)

    per_slot = [mx.array(expert) for _ in range(8)]
    mx.eval(per_slot)

    def stack8() -> None:
        mx.eval(mx.stack(per_slot))

    return (
        f"pool of {slots} slots ({pool.nbytes / 2**20:.0f} MiB): slice write {timed(write):.2f} ms, "
        f"while a pending graph reads the pool {timed(write_while_read, 3):.2f} ms, "
        f"stacking 8 per-slot experts {timed(stack8):.2f} ms"
    )


def main() -> None:
    mx.set_default_device(mx.cpu)
    expert = mx.random.normal((ROWS, COLS))
    mx.eval(expert)
    print(f"one expert matrix {ROWS}x{COLS} float32 = {expert.nbytes / 2**20:.1f} MiB")
    for slots in (64, 512):
        print(measure(slots, expert))


if __name__ == "__main__":
    main()
