"""What the runtime knows of its own health: failed reads and computes, and why it stopped.

A failed expert read or group compute fails only the requests that needed it; the runtime goes on.
It is ``degraded`` while an expert's last read failed (until a read of that expert succeeds, or
``window_s`` passes without another failure) or the last group compute failed. Only an error
that leaves the runtime unusable (computes failing group after group, or a bug in the runtime
itself) stops it: then it is ``failed``, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runahead.jobs import ExpertKey


class RequestFailed(RuntimeError):
    """A request ended by an error that hit it alone (a failed read of an expert it needed, a failed
    compute of its group), or by the engine closing or failing while it ran. The message says why."""


class RuntimeBroken(RuntimeError):
    """The runtime cannot go on (for example, computes failed group after group): it stops."""


@dataclass(slots=True)
class Health:
    """Failure counters and the last reason, for ``/health`` and metrics. Updated by the actors."""

    window_s: float = 60.0
    failing: dict[ExpertKey, tuple[float, str]] = field(default_factory=dict)  # last failure: time, why
    compute_failures_in_a_row: int = 0
    reads_failed: int = 0  # reads given up after their retries
    reads_retried: int = 0
    groups_failed: int = 0
    requests_failed: int = 0
    last_error: str = ""
    fatal: str = ""  # why the runtime stopped; empty while it runs

    def read_succeeded(self, key: ExpertKey) -> None:
        if self.failing:
            self.failing.pop(key, None)

    def read_retried(self, message: str) -> None:
        self.reads_retried += 1
        self.last_error = message

    def read_failed(self, key: ExpertKey, now: float, message: str) -> None:
        self.reads_failed += 1
        self.failing[key] = (now, message)
        self.last_error = message

    def compute_succeeded(self) -> None:
        self.compute_failures_in_a_row = 0

    def compute_failed(self, message: str) -> None:
        self.groups_failed += 1
        self.compute_failures_in_a_row += 1
        self.last_error = message

    def status(self, now: float) -> str:
        """``ok``, ``degraded`` (reads or computes failing now) or ``failed`` (stopped)."""
        if self.fatal:
            return "failed"
        return "degraded" if self._failing_now(now) or self.compute_failures_in_a_row else "ok"

    def _failing_now(self, now: float) -> list[str]:
        for key in [k for k, (when, _) in self.failing.items() if now - when > self.window_s]:
            del self.failing[key]  # no failure for a while: the disk may be fine again
        return [why for _, why in sorted(self.failing.values(), key=lambda item: item[0])]

    def report(self, now: float) -> dict[str, object]:
        """The status, with the reason when it is not ``ok``, and the failure counters."""
        status = self.status(now)
        report: dict[str, object] = {"status": status}
        if self.fatal:
            report["reason"] = self.fatal
        elif status == "degraded":
            failing = self._failing_now(now)
            report["reason"] = failing[-1] if failing else self.last_error
            report["failing_experts"] = len(failing)
        report.update(
            reads_failed=self.reads_failed,
            reads_retried=self.reads_retried,
            groups_failed=self.groups_failed,
            requests_failed=self.requests_failed,
        )
        return report
