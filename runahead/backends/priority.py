"""The compute thread's scheduling priority: ahead of the runtime's other threads on a core.

NOTE (why). On a CPU backend the compute thread shares the cores with the event loop (the actors) and
the store's reader threads, which copy each expert into its slot. When a group is handed to the
compute thread while the loop handles landing reads and a reader copies, the woken thread waits for a
core until the scheduler preempts one of them: on a 2-core Intel Xeon with AMX (2026-12-05), the
bottleneck rule at 2 and 4 requests behind a 3 GB/s link saw the hand-off take 1.1 ms at the 90th
percentile (58-76 us with no reads), ~1 ms a group on average, 21% of its compute. At nice -10 the
woken thread takes a core at once: the hand-off fell to ~0.4-0.5 ms a group, the thread ran 96-98%
of its group time instead of 89-94%, and tokens/s rose 2-16% where runahead is compute-bound (2 and 4
requests at 70% cache), unchanged where the link bounds the step and for sync (docs/results-torch.md,
"The compute thread ahead of the readers"; the demo's disk point showed no direction through its
noise). Lowering the readers instead (nice 10, ``SCHED_BATCH``) had shown no gain
(docs/tried.md), so the event loop is likely the thread it waited behind.

Raising a thread's priority needs root, ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it (30
for -10; the project's images run as a user without either unless given ``--ulimit nice=30:30``);
where it is refused, the thread runs as it was and the backend says so once in the log. Linux only
(elsewhere a thread's nice is not its own). ``RUNAHEAD_COMPUTE_NICE``: the nice value to ask for
(default :data:`COMPUTE_NICE`), or ``off`` to leave the thread alone.
"""

from __future__ import annotations

import os
import sys
import threading

import structlog

log = structlog.get_logger("runahead.backends")

COMPUTE_NICE = -10
"""The nice value the compute thread asks for (lower runs first; the loop and readers stay at 0)."""

ENV = "RUNAHEAD_COMPUTE_NICE"


def wanted_nice(value: str | None = None) -> int | None:
    """The nice value to ask for: ``value`` (default ``$RUNAHEAD_COMPUTE_NICE``) as an integer from -20
    to 19, ``off`` for none, :data:`COMPUTE_NICE` when unset. Anything else: ValueError naming what is
    accepted."""
    text = os.environ.get(ENV) if value is None else value
    if text is None or text == "":
        return COMPUTE_NICE
    if text.strip().lower() == "off":
        return None
    accepted = f"{ENV} must be an integer from -20 to 19 or 'off'"
    try:
        nice = int(text)
    except ValueError:
        raise ValueError(f"{accepted}, got {text!r}") from None
    return _in_range(nice, accepted)


def resolve_nice(nice: int | str | None) -> int | None:
    """A backend's ``compute_nice`` as the nice value to ask for: ``auto`` (:func:`wanted_nice`: the
    environment or :data:`COMPUTE_NICE`), an integer from -20 to 19, or None (leave the thread alone).
    Anything else: ValueError naming what is accepted."""
    if nice is None:
        return None
    if nice == "auto":
        return wanted_nice()
    accepted = "compute_nice must be an integer from -20 to 19, None or 'auto'"
    if isinstance(nice, bool) or not isinstance(nice, int):
        raise ValueError(f"{accepted}, got {nice!r}")
    return _in_range(nice, accepted)


def _in_range(nice: int, accepted: str) -> int:
    """``nice`` if it is one (-20 to 19), else ValueError saying ``accepted``."""
    if not -20 <= nice <= 19:
        raise ValueError(f"{accepted}, got {nice}")
    return nice


_refused = False  # the refusal is logged once per process


def prioritize_this_thread(nice: int | None) -> int | None:
    """Run the calling thread at ``nice`` if that is ahead of where it runs (Linux); return the nice it
    runs at now, or None where threads have no nice of their own (not Linux) or ``nice`` is None."""
    global _refused
    if nice is None or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if current <= nice:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as error:  # EPERM / EACCES: no CAP_SYS_NICE, RLIMIT_NICE too low
        if not _refused:
            _refused = True
            log.info(
                "compute thread left at its priority",
                asked=nice,
                runs_at=current,
                why=f"{error.strerror}: needs CAP_SYS_NICE (root) or RLIMIT_NICE; {ENV}=off to not ask",
            )
        return current
    return os.getpriority(os.PRIO_PROCESS, tid)
