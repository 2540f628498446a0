"""The adaptive grouping's chooser (runahead.mode): probes, exploits, margins, restarts."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from runahead.mode import Mode, ModeChooser

AHEAD, BATCH = Mode.AHEAD, Mode.BATCH


class Run:
    """Feeds a chooser tokens whose time depends on the mode it runs in (seconds per token)."""

    def __init__(self, chooser: ModeChooser) -> None:
        self.chooser = chooser
        self.now = 0.0
        self.steps: list[Mode] = []  # the mode each step ran in

    def steps_of(self, count: int, cost: Callable[[Mode], float], requests: int = 4) -> None:
        for _ in range(count):
            mode = self.chooser.mode
            self.steps.append(mode)
            for _ in range(requests):
                self.now += cost(mode)
                self.chooser.token(self.now, requests)


def costs(ahead: float, batch: float) -> Callable[[Mode], float]:
    return lambda mode: ahead if mode is AHEAD else batch


def test_it_probes_both_modes_then_keeps_the_faster() -> None:
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=8, max_exploit_steps=32)
    run = Run(chooser)
    run.steps_of(1, costs(0.010, 0.008))  # the first token only starts the window
    run.steps_of(400, costs(0.010, 0.008))
    # settling + 2 measured steps of ahead, then 1 + 2 of batch, then batch is exploited
    assert run.steps[:7] == [AHEAD] * 4 + [BATCH] * 3
    assert chooser.incumbent is BATCH
    assert chooser.seconds_per_token[AHEAD, 4] == pytest.approx(0.010)
    assert chooser.seconds_per_token[BATCH, 4] == pytest.approx(0.008)
    # each re-probe of ahead loses, so the exploit window grew to its cap
    assert chooser.exploit_steps == 32
    assert run.steps[-200:].count(AHEAD) <= 6 * 3  # at most 3 settling + 2 probe steps, 6 times
    assert run.steps.count(BATCH) > 0.9 * len(run.steps)


def test_a_challenger_within_the_margin_does_not_take_over_but_a_clear_one_does() -> None:
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=4, max_exploit_steps=16, margin=0.05)
    run = Run(chooser)
    run.steps_of(40, costs(0.010, 0.012))
    assert chooser.incumbent is AHEAD
    switches = chooser.switches
    run.steps_of(120, costs(0.010, 0.0097))  # batch now 3% faster: inside the margin
    assert chooser.incumbent is AHEAD
    assert chooser.exploit_steps == 16  # the incumbent kept winning
    assert chooser.switches - switches <= 2 * 120 // 16 + 2  # only the probes switched
    run.steps_of(60, costs(0.010, 0.008))  # batch 20% faster: it takes over
    assert chooser.incumbent is BATCH
    assert run.steps[-10:] == [BATCH] * 10


def test_the_first_choice_takes_the_faster_mode_without_a_margin() -> None:
    chooser = ModeChooser(probe_steps=1, first_exploit_steps=4, margin=0.5)
    run = Run(chooser)
    run.steps_of(8, costs(0.010, 0.0099))
    assert chooser.incumbent is BATCH


def test_measurements_are_kept_per_number_of_active_requests() -> None:
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=4)
    run = Run(chooser)
    run.steps_of(20, costs(0.010, 0.012), requests=8)
    run.steps_of(20, costs(0.005, 0.004), requests=2)
    assert chooser.seconds_per_token[AHEAD, 8] == pytest.approx(0.010)
    assert chooser.seconds_per_token[BATCH, 2] == pytest.approx(0.004)
    assert chooser.mode is BATCH  # at 2 requests batching is the faster
    # every window lies within one concurrency: none mixes 8-request and 2-request steps
    assert {round(seconds, 6) for _, _, seconds, _ in chooser.log} <= {0.010, 0.012, 0.005, 0.004}


def test_a_prompt_pass_restarts_the_window() -> None:
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=4)
    run = Run(chooser)
    run.steps_of(3, costs(0.010, 0.008))  # a first token, settling, one measured step
    chooser.token(run.now + 1.0, 4, prompt=True)  # a slow prompt pass: not measured
    run.now += 1.0
    run.steps_of(2, costs(0.010, 0.008))  # settling again, then the window's first measured step
    assert list(chooser.log) == []
    run.steps_of(1, costs(0.010, 0.008))
    assert list(chooser.log) == [(AHEAD, 4, pytest.approx(0.010), BATCH)]


@pytest.mark.parametrize(
    "settings", [{"probe_steps": 0}, {"first_exploit_steps": 8, "max_exploit_steps": 4}, {"margin": 1.0}]
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ModeChooser(**settings)  # type: ignore[arg-type]


def test_under_the_step_barrier_a_switch_needs_no_settling_step() -> None:
    """Each probe of the loser is its measured steps alone: one step fewer each time."""
    lengths = {}
    for settle in (True, False):
        chooser = ModeChooser(probe_steps=2, first_exploit_steps=8, settle_switches=settle)
        run = Run(chooser)
        run.steps_of(41, costs(0.010, 0.008))
        lengths[settle] = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps)]
    # (the harness counts a step from its first token, the chooser's steps end there: one apart)
    assert lengths[True][:4] == [(AHEAD, 4), (BATCH, 11), (AHEAD, 3), (BATCH, 17)]
    assert lengths[False][:4] == [(AHEAD, 4), (BATCH, 10), (AHEAD, 2), (BATCH, 16)]


def test_the_log_keeps_the_latest_windows_only() -> None:
    """A chooser of an engine that serves for days keeps a bounded log; switches are still all counted."""
    from runahead.mode import LOG_WINDOWS

    chooser = ModeChooser(probe_steps=1, first_exploit_steps=1, max_exploit_steps=1)
    run = Run(chooser)
    run.steps_of(4 * LOG_WINDOWS, lambda mode: 0.010 if mode is AHEAD else 0.020)
    assert len(chooser.log) == LOG_WINDOWS
    assert chooser.switches > LOG_WINDOWS  # more switches than windows kept: the counter is not the log's
