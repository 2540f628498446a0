"""The paper's evaluation on the sim backend: every figure as a PNG plus the JSONL rows behind it.

Entry point: :func:`run_paper` (``runahead bench paper --out DIR [--quick] [--workers N]``).
Modules: :mod:`~runahead.paper.settings` (what each figure measures), :mod:`~runahead.paper.runner`
(parallel, resumable sweeps), :mod:`~runahead.paper.precision` (the prefetch-precision replay),
:mod:`~runahead.paper.figures` (drawing), :mod:`~runahead.paper.summary` (headline numbers).
"""

from runahead.paper.run import run_paper, settings_for, write_timeline
from runahead.paper.settings import FIGURES, FULL, QUICK, TINY, PrecisionPoint, Settings, figure_points

__all__ = [
    "FIGURES",
    "FULL",
    "QUICK",
    "TINY",
    "PrecisionPoint",
    "Settings",
    "figure_points",
    "run_paper",
    "settings_for",
    "write_timeline",
]
