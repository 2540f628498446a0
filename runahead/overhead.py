"""The runtime's own CPU cost: per job, per group and per expert read, and its split across rows.

Under ``runahead bench --zero-cost`` every cost in the sim is zero, so a run's CPU time is the
runtime's own (plus the sim's bookkeeping); :func:`overhead_row` divides it by each count, and
:func:`fit_overhead` separates what a job, a group and a read each cost from rows with different
group sizes and read rates (docs/results-core.md, "Runtime overhead per job").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runahead.metrics import host_cpu


def overhead_row(cpu: float, jobs: int, groups: int, reads: int) -> dict[str, float]:
    """The run's CPU time per job, per group and per expert read (each the whole CPU time divided).

    Under ``zero_cost`` that CPU time is the runtime's own (plus the sim's bookkeeping);
    :func:`fit_overhead` splits it into a cost per job, per group and per read across rows.
    """
    return {
        "overhead_us_per_job": cpu / jobs * 1e6 if jobs else float("nan"),
        "overhead_us_per_group": cpu / groups * 1e6 if groups else float("nan"),
        "overhead_us_per_read": cpu / reads * 1e6 if reads else float("nan"),
    }


def fit_overhead(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Least squares ``cpu = a * jobs + b * groups + c * reads`` over rows of one run; None if too few.

    Rows with different group sizes (policies) and read rates (cache fractions) separate the three
    costs: ``a`` is what a job costs wherever it goes, ``b`` a group's extra (a backend call, the
    scheduler's choice and its round trip to the issuer), ``c`` an expert read's (a link worker's
    wake-ups, the fetch queue, eviction, the notice to the issuer and the job's release).
    """
    usable = [r for r in rows if r.get("cpu_s") is not None and r.get("jobs")]
    if len(usable) < 3:
        return None
    design = np.array([[r["jobs"], r["groups_run"], r["reads"]] for r in usable], dtype=float)
    cpu = np.array([r["cpu_s"] for r in usable])
    if np.linalg.matrix_rank(design) < 3:
        return None
    (job, group, read), *_ = np.linalg.lstsq(design, cpu, rcond=None)
    predicted = design @ np.array([job, group, read])
    return {
        "us_per_job": job * 1e6,
        "us_per_group": group * 1e6,
        "us_per_read": read * 1e6,
        "max_error": float(np.max(np.abs(predicted - cpu) / cpu)),
    }


def format_overhead(rows: Sequence[dict[str, Any]]) -> str:
    """The runtime's CPU time per job, group and read of each row, and their split across rows."""
    lines = [
        "",
        f"CPU time on {host_cpu()}:",
        f"{'policy':<28} {'conc':>4} {'cache':>5} {'jobs':>7} {'groups':>6} {'reads':>6} "
        f"{'us/job':>7} {'us/group':>8} {'us/read':>7}",
    ]
    for row in rows:
        lines.append(
            f"{row['policy']:<28} {row['concurrency']:>4} {row['cache_fraction']:>5.2f} {row['jobs']:>7} "
            f"{row['groups_run']:>6} {row['reads']:>6} {row['overhead_us_per_job']:>7.1f} "
            f"{row['overhead_us_per_group']:>8.1f} {row['overhead_us_per_read']:>7.1f}"
        )
    fit = fit_overhead(rows)
    if fit is not None:
        lines.append(
            f"least squares over these rows: {fit['us_per_job']:.1f} us per job + {fit['us_per_group']:.1f} "
            f"us per group + {fit['us_per_read']:.1f} us per read (worst row off by {fit['max_error']:.0%})"
        )
    return "\n".join(lines)
