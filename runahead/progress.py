"""Progress bars for long command-line work (bench sweeps, ``bench paper``, model builds), drawn with rich.

A bar is drawn on stderr only when stderr is a terminal; log lines (see :mod:`runahead.logs`) still
say what finished, so a log file or CI output reads the same without the bar.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[int], None]
"""Called with the number of items finished so far."""


@contextmanager
def progress_bar(description: str, total: int | None, *, enabled: bool = True) -> Iterator[Advance]:
    """A bar of ``total`` items (a spinner when ``None``) while the block runs; yields ``advance(done)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)
