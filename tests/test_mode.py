"""The adaptive grouping's chooser (runahead.mode): probes, exploits, margins, restarts."""

from __future__ import annotations

import itertools
import math
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
    # settling + 2 measured steps of ahead, then 1 + 2 of batch, which won: ahead is measured again
    # (1 + 2) to confirm it, then batch is exploited
    assert run.steps[:11] == [AHEAD] * 4 + [BATCH] * 3 + [AHEAD] * 3 + [BATCH]
    assert chooser.incumbent is BATCH
    assert chooser.seconds_per_token[AHEAD, 4] == pytest.approx(0.010)
    assert chooser.seconds_per_token[BATCH, 4] == pytest.approx(0.008)
    # each re-probe of ahead loses, so the exploit window grew to its cap
    assert chooser.exploit_steps == 32
    assert run.steps[-200:].count(AHEAD) <= 6 * 3  # at most 3 settling + 2 probe steps, 6 times
    assert run.steps.count(BATCH) > 0.88 * len(run.steps)


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
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=4, probe_budget=1.0)
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
    "settings",
    [
        {"probe_steps": 0},
        {"first_exploit_steps": 8, "max_exploit_steps": 4},
        {"margin": 1.0},
        {"probe_budget": 0.0},
        {"probe_budget": 1.5},
    ],
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ModeChooser(**settings)  # type: ignore[arg-type]


def test_under_the_step_barrier_a_switch_needs_no_settling_step() -> None:
    """Each probe of the loser is its measured steps alone: one step fewer each time."""
    lengths = {}
    for settle in (True, False):
        chooser = ModeChooser(probe_steps=2, first_exploit_steps=8, probe_budget=1.0, settle_switches=settle)
        run = Run(chooser)
        run.steps_of(41, costs(0.010, 0.008))
        lengths[settle] = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps)]
    # (the harness counts a step from its first token, the chooser's steps end there: one apart)
    # probe, probe (batch wins), ahead again to confirm, exploit batch 8, probe ahead, exploit batch 16
    assert lengths[True][:6] == [(AHEAD, 4), (BATCH, 3), (AHEAD, 3), (BATCH, 9), (AHEAD, 3), (BATCH, 17)]
    assert lengths[False][:6] == [(AHEAD, 4), (BATCH, 2), (AHEAD, 2), (BATCH, 8), (AHEAD, 2), (BATCH, 16)]


def test_one_slow_window_does_not_hand_the_run_to_the_slower_mode() -> None:
    """A pause of the machine during the first probe of running ahead (its two measured steps at
    twice their cost) makes batching win the first comparison; the confirming probe of running
    ahead measures it as it is, and running ahead is exploited: batching runs its probes only."""
    chooser = ModeChooser(
        probe_steps=2, first_exploit_steps=8, max_exploit_steps=32, probe_budget=1.0, settle_switches=False
    )
    run = Run(chooser)
    paused = iter([2.0] * 8 + [1.0] * 10**6)  # the tokens of the first two measured steps

    def cost(mode: Mode) -> float:
        if mode is BATCH:
            return 0.012
        return 0.010 * (next(paused) if len(run.steps) > 1 else 1.0)

    run.steps_of(200, cost)
    segments = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps)]
    assert segments[:4] == [(AHEAD, 4), (BATCH, 2), (AHEAD, 2 + 8), (BATCH, 2)]
    assert [entry[3] for entry in list(chooser.log)[:3]] == [BATCH, AHEAD, AHEAD]  # probe, probe, confirm
    assert chooser.incumbent is AHEAD
    assert all(length == 2 for mode, length in segments if mode is BATCH)  # its probes alone


def test_a_confirmed_challenger_still_takes_over() -> None:
    """A challenger that wins its probe and the confirming one takes over: the confirmation delays a
    switch by one probe of the loser, it does not stop it."""
    chooser = ModeChooser(probe_steps=2, first_exploit_steps=8, max_exploit_steps=32, settle_switches=False)
    run = Run(chooser)
    run.steps_of(60, costs(0.010, 0.012))
    assert chooser.incumbent is AHEAD
    start = len(run.steps)
    run.steps_of(80, costs(0.010, 0.008))  # batch now clearly faster
    assert chooser.incumbent is BATCH
    after = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps[start:])]
    # batch's probe wins, ahead is probed to confirm, then batch is exploited from then on
    assert (AHEAD, 2) in after and after[-1][0] is BATCH and after[-1][1] >= 8


def test_the_log_keeps_the_latest_windows_only() -> None:
    """A chooser of an engine that serves for days keeps a bounded log; switches are still all counted."""
    from runahead.mode import LOG_WINDOWS

    chooser = ModeChooser(probe_steps=1, first_exploit_steps=1, max_exploit_steps=1)
    run = Run(chooser)
    run.steps_of(4 * LOG_WINDOWS, lambda mode: 0.010 if mode is AHEAD else 0.020)
    assert len(chooser.log) == LOG_WINDOWS
    assert chooser.switches > LOG_WINDOWS  # more switches than windows kept: the counter is not the log's


def test_the_confirming_probe_of_the_incumbent_keeps_the_margin() -> None:
    """A challenger's probe beat the incumbent by more than the margin; the incumbent, measured again,
    is slower than that probe but within the margin of it: it stays (without the margin it would not)."""
    chooser = ModeChooser(probe_steps=1, first_exploit_steps=1, max_exploit_steps=1, settle_switches=False)
    now = 0.0
    chooser.token(now, 1)  # the first token: the window settles over the next step
    for seconds in (0.0, 0.010, 0.012, 0.010, 0.009, 0.0094):  # settle; ahead, batch, ahead, batch, ahead
        now += seconds
        chooser.token(now, 1)
    assert [(mode, chosen) for mode, _, _, chosen in chooser.log] == [
        (AHEAD, BATCH),  # first probe
        (BATCH, AHEAD),  # batch slower: ahead is the incumbent
        (AHEAD, BATCH),  # its exploit window, then batch is probed
        (BATCH, AHEAD),  # batch 10% faster: ahead is measured again to confirm
        (AHEAD, AHEAD),  # 0.0094 is within 5% of batch's 0.009: ahead stays
    ]
    assert chooser.incumbent is AHEAD


@pytest.mark.parametrize("settle", [True, False], ids=["settling", "barrier"])
def test_a_wide_gap_is_probed_seldom_from_the_first_choice(settle: bool) -> None:
    """Batching 30% slower a step: the first exploit window is long enough that probing batching
    again costs 1% of it (its steps x the gap it measured / 0.01), not the doubling's 16 steps; over
    a long run the probes of the loser cost about the budget."""
    chooser = ModeChooser(probe_steps=2, settle_switches=settle)
    run = Run(chooser)
    run.steps_of(400, costs(0.010, 0.013))
    segments = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps)]
    (_, _, ahead, _), (_, _, batch, _) = list(chooser.log)[:2]
    # (the harness counts a step from its first token, the chooser's steps end there: one apart, so
    # without a settling step a window measures one token of the mode before it: ~19% slower)
    assert batch / ahead == pytest.approx(1.3 if settle else 1.1875)
    loser_steps = 2 + settle  # a probe's measured steps and, where switches settle, its settling step
    first_window = math.ceil(loser_steps * (batch / ahead - 1) / 0.01)
    assert first_window > 2 * 16
    assert chooser.incumbent is AHEAD
    # ahead probed (after the start's settling step), batch probed, then ahead exploited for the
    # window's measured steps plus, with settling, the step that settles back
    assert segments[:3] == [(AHEAD, 4), (BATCH, 2 + settle), (AHEAD, first_window + settle)]
    # later windows double from there, up to the cap
    assert segments[4] == (AHEAD, min(2 * first_window, 128) + settle)
    doubling = Run(ModeChooser(probe_steps=2, probe_budget=1.0, settle_switches=settle))
    doubling.steps_of(400, costs(0.010, 0.013))
    assert run.steps.count(BATCH) < doubling.steps.count(BATCH)


def test_a_gap_within_the_doubling_leaves_its_windows_alone() -> None:
    """Batching 4% slower: 2 steps x 0.04 / 0.01 = 8 steps, under the first window of 16, so the
    windows are the doubling's: 16, then 32."""
    chooser = ModeChooser(probe_steps=2, settle_switches=False)
    run = Run(chooser)
    run.steps_of(80, costs(0.010, 0.0104))
    segments = [(mode, len(list(steps))) for mode, steps in itertools.groupby(run.steps)]
    assert segments[:5] == [(AHEAD, 4), (BATCH, 2), (AHEAD, 16), (BATCH, 2), (AHEAD, 32)]
