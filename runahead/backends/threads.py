"""The torch backend's compute threads on CPU: named by the user, or every core but one.

NOTE (why not all of them, torch's default). The compute thread does not run alone: the event loop
(the actors) and the store's reader threads (O_DIRECT reads, and the copy of each expert into its
cache slot) run beside it on the same cores. A decode group's products are small, and with as many
intra-op threads as cores every one of them waits for its slowest thread, which is often one the
readers or the loop just displaced. Measured on a 2-core machine (docs/results-torch.md, "Compute
threads"): with one thread instead of two, sync's compute per step fell by a quarter on the medium
model at 8 requests (experts read while it computes), runahead's many small groups gained more, and the
demo's small model went from no gain to a clear one; one request with every expert resident (nothing
read beside it) was as fast either way. So ``auto`` leaves one core to the rest of the runtime.

torch's intra-op thread count is one setting per process (``torch.set_num_threads``): the backend sets
it when it opens, and it holds for all of the process's torch work from then on. The CPU kernel of
stored experts (:mod:`runahead.models.qkernel`) splits a call over the same count.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

THREAD_CHOICES_HELP = "torch on CPU: intra-op compute threads, or auto (every core but one, at least one)"
"""What ``--threads`` says it takes."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


def resolve_threads(threads: int | str, device: str | torch.device) -> int | None:
    """The intra-op threads to compute with: ``threads`` (a count >= 1, or ``auto``) on CPU.

    ``auto`` on CPU: every core but one (:func:`available_cores` - 1), at least one. On CUDA the
    device computes and torch's own setting is left alone: None (a count given for CUDA is refused,
    as it would do nothing). Anything else: ValueError naming what is accepted.
    """
    if isinstance(threads, bool) or not (threads == "auto" or isinstance(threads, int)):
        raise ValueError(f"threads must be a count >= 1 or 'auto', got {threads!r}")
    if isinstance(threads, int) and threads < 1:
        raise ValueError(f"threads must be a count >= 1 or 'auto', got {threads}")
    if torch.device(device).type != "cpu":
        if threads != "auto":
            raise ValueError(f"threads sets the CPU's compute threads; the device {device!s} computes here")
        return None
    return max(1, available_cores() - 1) if threads == "auto" else int(threads)


def use_threads(threads: int | str, device: str | torch.device) -> int:
    """Set torch's intra-op threads for ``threads`` on ``device`` (:func:`resolve_threads`); return the
    count torch now uses."""
    count = resolve_threads(threads, device)
    if count is not None and count != torch.get_num_threads():
        torch.set_num_threads(count)
    return torch.get_num_threads()


@contextlib.contextmanager
def threads_for(threads: int | str, device: str | torch.device) -> Iterator[int]:
    """:func:`use_threads` for the work inside (a backend's open), yielding the count; if that work
    fails, torch's count is put back as it was: a model that does not open changes nothing."""
    before = torch.get_num_threads()
    count = use_threads(threads, device)
    try:
        yield count
    except BaseException:
        torch.set_num_threads(before)
        raise
