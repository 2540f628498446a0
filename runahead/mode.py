"""Running ahead or batching: keep whichever this run measures faster (``runahead``'s adaptive grouping).

Running ahead buys overlap (the link reads while the compute unit works on requests whose experts
are resident) and pays for it with smaller groups, each of which reads the shared weights again.
Where the overlap hides less than the small groups cost, one group of every request (*batching*,
``sync``'s grouping) is faster. The bottleneck rule prices that trade from its inputs, but on a real
backend one cost it cannot see decides it: the reads and the compute share the machine. On two CPU
cores with experts on disk, runahead's reads took 1.7x longer a step than sync's for the same bytes
and its compute 3.3x (docs/results-torch.md, "The demo's point on an AVX2 EPYC"). A measurement sees
both (what it found: docs/results-torch.md, "Adaptive grouping").

:class:`ModeChooser` measures. It is pure (no clock, no I/O): the scheduler tells it when each token
was generated, how many requests were active and whether a prompt pass ran since the last token; it
answers with the mode to run in. It works in *steps* (one token per active request) and in windows
of steps:

- **probe**: run a mode for :data:`PROBE_STEPS` measured steps, after one settling step when the
  mode changed with jobs of the other mode still in flight (none are under the step barrier);
- once both modes are measured, **exploit** the faster for :data:`FIRST_EXPLOIT_STEPS` steps, then
  probe the other again. A challenger takes over only if faster by :data:`SWITCH_MARGIN`; each time
  the incumbent wins again its exploit window doubles, up to :data:`MAX_EXPLOIT_STEPS`, so a run
  with a clear winner spends less and less of its time probing the loser; and the window is at
  least long enough that the next probe of the loser costs at most :data:`PROBE_BUDGET` of it (the
  loser's steps times how much slower it measured), so a wide gap is probed seldom from the first
  choice on: behind a 3 GB/s link, batching 20-40% slower, the doubling alone spent 10% of a
  32-step run in batching probes;
- **confirm** before a probe's winner is exploited: when the mode just probed beats the other's
  latest window, the other is probed once more and the choice is made on that fresh pair (with the
  margin, where there is an incumbent, still in its favour). One slow window (a pause of the
  machine, not of the mode) no longer hands the run to the slower mode: behind a 0.6 GB/s link a
  first probe of running ahead measured 16.4 ms a token against its usual 11.4, batching won the
  first choice at 14.1, and the run batched a third of its steps, 8% of its tokens/s in 4 of 8 runs
  (docs/results-torch.md, "The chooser confirms before it switches"). The cost is one more probe of
  the loser each time a challenger wins.

A window is measured as seconds per token. Measurements are kept per number of active requests (a
step of 2 and one of 8 do not compare), and a window restarts (settling again) when that number
changes or a prompt is being processed, so only steady decode is compared. Neither mode changes a
token: every grouping computes the same jobs (tests/test_mode.py, tests/test_torch_backend.py).
"""

from __future__ import annotations

import enum
import math
from collections import deque

PROBE_STEPS = 2
"""Measured steps of a probe (after one settling step when the mode changed)."""
FIRST_EXPLOIT_STEPS = 16
"""Measured steps the faster mode runs, once chosen, before the other is probed again."""
MAX_EXPLOIT_STEPS = 128
"""The longest exploit window: each win of the incumbent doubles its window up to this."""
SWITCH_MARGIN = 0.05
"""A challenger must be this much faster (seconds per token) to take over from the incumbent."""
PROBE_BUDGET = 0.01
"""The most a probe of the losing mode may cost, as a share of the exploit window before it: after a
choice the window is at least ``loser steps x gap / PROBE_BUDGET`` measured steps (up to
:data:`MAX_EXPLOIT_STEPS`), where ``gap`` is how much slower per token the loser measured and its
steps are a probe's measured steps and its settling step. A gap under 8% (5% with settling steps)
leaves the first window at :data:`FIRST_EXPLOIT_STEPS`; a loser 26% slower gets 52 steps (78 with
settling) between probes instead of 16."""
LOG_WINDOWS = 256
"""Finished windows :attr:`ModeChooser.log` keeps, the latest (an engine serving for days would
otherwise keep one entry a window for as long as it runs)."""


class Mode(enum.Enum):
    """What the scheduler's grouping does: the bottleneck rule (``AHEAD``) or one group of every
    request (``BATCH``)."""

    AHEAD = "ahead"
    BATCH = "batch"

    @property
    def other(self) -> Mode:
        return Mode.BATCH if self is Mode.AHEAD else Mode.AHEAD


class ModeChooser:
    """Chooses the scheduler's mode from measured seconds per token (see the module docstring).

    ``settle_switches``: a switch of mode is followed by a settling step, not measured; off where a
    step boundary leaves nothing of the last step in flight (the step barrier), so a probe there is
    its measured steps alone. A window restarted by a change of requests or a prompt pass settles
    either way. ``probe_budget`` (default :data:`PROBE_BUDGET`; 1 all but turns it off) sizes exploit
    windows by how much slower the loser measured.
    ``seconds_per_token`` holds each mode's latest measurement per number of active requests;
    ``switches`` counts changes of mode; ``log`` keeps the latest :data:`LOG_WINDOWS` finished windows
    as (mode, requests, seconds per token, the mode chosen next).
    """

    def __init__(
        self,
        probe_steps: int | None = None,
        first_exploit_steps: int | None = None,
        max_exploit_steps: int | None = None,
        margin: float | None = None,
        probe_budget: float | None = None,
        *,
        settle_switches: bool = True,
    ) -> None:
        self.probe_steps = PROBE_STEPS if probe_steps is None else probe_steps
        self.first_exploit_steps = FIRST_EXPLOIT_STEPS if first_exploit_steps is None else first_exploit_steps
        self.max_exploit_steps = MAX_EXPLOIT_STEPS if max_exploit_steps is None else max_exploit_steps
        self.margin = SWITCH_MARGIN if margin is None else margin
        self.probe_budget = PROBE_BUDGET if probe_budget is None else probe_budget
        self.settle_switches = settle_switches
        if self.probe_steps < 1 or self.first_exploit_steps < 1:
            raise ValueError("probe and exploit windows need one measured step at least")
        if self.max_exploit_steps < self.first_exploit_steps or not 0 <= self.margin < 1:
            raise ValueError("need max_exploit_steps >= first_exploit_steps and 0 <= margin < 1")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget is a share of a window: 0 < budget <= 1, got {self.probe_budget}")
        self.mode = Mode.AHEAD
        self.exploiting = False  # False: the current window is a probe
        self.incumbent: Mode | None = None  # the mode chosen to exploit, once both were measured
        self.exploit_steps = self.first_exploit_steps
        self.seconds_per_token: dict[tuple[Mode, int], float] = {}
        self.switches = 0
        self.log: deque[tuple[Mode, int, float, Mode]] = deque(maxlen=LOG_WINDOWS)
        self._requests = 0  # active requests in the current window
        self._tokens = 0  # tokens since the last step boundary
        self._settling = True  # the window's first step is not measured
        self._steps_left = self.probe_steps  # measured steps left in the window
        self._start = 0.0  # when measuring began
        self._measured = 0  # measured steps so far
        self._confirming = False  # the current probe measures again the mode a probe just beat

    def token(self, now: float, requests: int, prompt: bool = False) -> Mode:
        """A token was generated at ``now`` with ``requests`` active; ``prompt``: a prompt pass was
        computed since the previous token. Returns the mode to run in from here."""
        if requests != self._requests or prompt:
            if requests != self._requests:
                self._confirming = False  # what it would confirm was measured at another count
            self._requests = requests
            self._restart(now, settle=True)
            return self.mode
        self._tokens += 1
        if self._tokens < requests:
            return self.mode
        self._tokens = 0  # a step boundary
        if self._settling:
            self._settling, self._start, self._measured = False, now, 0
            return self.mode
        self._measured += 1
        self._steps_left -= 1
        if self._steps_left <= 0:
            self._window_done(now, (now - self._start) / (self._measured * requests))
        return self.mode

    def _restart(self, now: float, *, settle: bool) -> None:
        """Start the current window again: at the next step boundary if ``settle``, else now."""
        self._tokens = 0
        self._steps_left = self.exploit_steps if self.exploiting else self.probe_steps
        self._settling, self._start, self._measured = settle, now, 0

    def _wins(self, mode: Mode, seconds: float, other: float) -> bool:
        """Whether ``mode``, measured at ``seconds`` a token, beats the other mode's ``other``: a
        challenger must be faster than the incumbent by the margin; with no incumbent, just faster."""
        if self.incumbent is None:
            return seconds < other
        if self.incumbent is mode:
            return seconds * (1.0 - self.margin) <= other
        return seconds < other * (1.0 - self.margin)

    def _budget_window(self, chosen: Mode, requests: int) -> int:
        """The shortest exploit window of ``chosen`` in which the next probe of the other mode costs
        at most :attr:`probe_budget` of it, from the latest measurement of each (at most
        :attr:`max_exploit_steps`; 0 where the other mode measured no slower)."""
        winner = self.seconds_per_token[chosen, requests]
        loser = self.seconds_per_token[chosen.other, requests]
        if winner <= 0.0 or loser <= winner:
            return 0
        loser_steps = self.probe_steps + self.settle_switches  # its measured steps and its settling one
        window = loser_steps * (loser / winner - 1.0) / self.probe_budget
        return min(math.ceil(window), self.max_exploit_steps)

    def _window_done(self, now: float, seconds: float) -> None:
        mode, requests = self.mode, self._requests
        self.seconds_per_token[mode, requests] = seconds
        other = self.seconds_per_token.get((mode.other, requests))
        won = other is not None and self._wins(mode, seconds, other)
        if other is None or self.exploiting:
            chosen, exploit = mode.other, False  # measure the other mode (again)
        elif won and not self._confirming:
            chosen, exploit, self._confirming = mode.other, False, True  # measure the loser again first
        else:
            chosen, exploit, self._confirming = (mode if won else mode.other), True, False
            if chosen is self.incumbent:
                self.exploit_steps = min(2 * self.exploit_steps, self.max_exploit_steps)
            else:
                self.incumbent, self.exploit_steps = chosen, self.first_exploit_steps
            self.exploit_steps = max(self.exploit_steps, self._budget_window(chosen, requests))
        self.log.append((mode, requests, seconds, chosen))
        changed = chosen is not mode
        self.switches += changed
        self.mode, self.exploiting = chosen, exploit
        # staying in the same mode needs no settling step, nor a switch where a step boundary
        # leaves nothing in flight (the step barrier)
        self._restart(now, settle=changed and self.settle_switches)
