"""offload_ratio auto (weaver/weaving/placement.py AdaptivePlacement) on sequences of the
inputs the hot scheduler feeds it: each step's time, its local and remote sequences and
whether it ran decodes only, and the pair's load (synthetic sequences: a step time of a
fixed cost plus a cost per sequence, the shape of a decode step)."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest

from weaver.weaving.placement import (
    COLD_CUT_HOLD_S,
    AdaptivePlacement,
    AdaptiveTargets,
    PairLoad,
    Placement,
    RatioPlacement,
    StepTimeModel,
    cold_order,
    placement_for,
)
from weaver.weaving.tpot_tail import TpotTail

BOTH = [Placement.LOCAL, Placement.REMOTE]


def steps(fixed: float, per_local: float, per_remote: float, batches, decode_only=True):
    """Steps of a linear cost model over the given (local, remote) batches."""
    return [(fixed + per_local * nl + per_remote * nr, nl, nr, decode_only)
            for nl, nr in batches]


# Local batches of 3-4 (KV-capped), then woven ones growing to 4 + 6.
LOCAL_BATCHES = [(3, 0), (4, 0)] * 6
WOVEN_BATCHES = [(4, r) for r in itertools.chain(range(1, 7), range(6, 0, -1))] * 2


def feed(placement: AdaptivePlacement, sequence, start: float = 0.0, gap: float = 0.1):
    """Observe each step and update() after it; the (time, is_open) of every change."""
    now, changes = start, []
    for step_s, num_local, num_remote, decode_only in sequence:
        placement.observe_step(step_s, num_local, num_remote, decode_only)
        now += gap
        if placement.update(now):
            changes.append((now, placement.is_open))
    return now, changes


def test_auto_is_local_first_and_spills_while_open():
    placement = placement_for("auto")
    assert isinstance(placement, AdaptivePlacement)
    assert placement.order(0, 0) == BOTH
    assert placement.order(5, 3) == BOTH  # never remote first; no cap until TPOT says so


def test_the_step_time_model_recovers_its_costs_and_waits_for_distinct_batches():
    model = StepTimeModel()
    for step_s, nl, nr, _ in steps(0.030, 0.002, 0.004, [(4, 0)] * 10):
        model.add(nl, nr, step_s)
    assert model.coefficients(min_samples=8) is None  # one batch: costs cannot be told apart
    for step_s, nl, nr, _ in steps(0.030, 0.002, 0.004, LOCAL_BATCHES + WOVEN_BATCHES):
        model.add(nl, nr, step_s)
    assert model.coefficients(min_samples=8) == pytest.approx((0.030, 0.002, 0.004))
    # 4 local + 6 remote: 10 / 0.062 tokens/s against 4 / 0.038.
    assert model.gain(4, 6, min_samples=8) == pytest.approx((10 / 0.062) / (4 / 0.038))


def test_weaving_within_the_tpot_target_stays_on_uncapped():
    # Weights dominate the step (30 ms); a sequence adds 2 ms locally, 4 ms remotely.
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    placement.observe_pair(PairLoad(cold_inflation=1.04, offload_wait_s=0.002))
    _, changes = feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES + WOVEN_BATCHES))
    assert changes == [] and placement.is_open and placement.remote_cap is None
    report = placement.report()
    assert report["weaving_active"] and report["woven_gain"] > 1.2


def test_remote_goes_first_while_a_remote_sequence_costs_the_hot_step_less():
    """On a device whose attention is a large share of the step (this CPU), a remote
    sequence's attention runs on the cold device meanwhile: it adds less to the hot step
    than a local one, and the policy then fills the remote pool first."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    # 2 ms per local sequence, 1 ms per remote one.
    feed(placement, steps(0.030, 0.002, 0.001, LOCAL_BATCHES + WOVEN_BATCHES))
    assert placement.remote_first and placement.order(4, 2) == [Placement.REMOTE,
                                                               Placement.LOCAL]
    assert "remote first" in placement.reason and placement.report()["remote_first"]
    # The costs turn (a busier cold device): local first again, once a remote sequence
    # costs more than a local one; between the two, the order stays.
    placement.model = StepTimeModel()
    feed(placement, steps(0.030, 0.002, 0.0021, LOCAL_BATCHES + WOVEN_BATCHES))
    assert placement.remote_first is False and placement.order(4, 2) == BOTH
    placement.model = StepTimeModel()
    feed(placement, steps(0.030, 0.002, 0.0019, LOCAL_BATCHES + WOVEN_BATCHES))
    assert placement.remote_first is False


def test_a_fit_that_cannot_tell_the_costs_apart_keeps_local_first():
    """Remote first rests on the step-time fit: not on one whose saving is within its
    noise, nor on one that says a sequence makes the step shorter (seen on this CPU:
    -3.7 ms a remote sequence), which placed sequences on a cold that could not take one."""
    rng = random.Random(0)
    noisy = [(step_s + rng.gauss(0, 0.010), nl, nr, only)
             for step_s, nl, nr, only in steps(0.030, 0.002, 0.0015,
                                               LOCAL_BATCHES + WOVEN_BATCHES)]
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    feed(placement, noisy)
    _, per_local, per_remote = placement.model.coefficients(8)
    assert per_remote < 0.9 * per_local  # the point fit alone would say remote first
    assert abs(placement.model.contrast_z((0, 0.9, -1), 8)) < 2
    assert placement.remote_first is False and placement.order(4, 2) == BOTH
    # Exact costs, but a remote sequence "saves" time: a fit without meaning.
    negative = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    feed(negative, steps(0.030, 0.002, -0.001, LOCAL_BATCHES + WOVEN_BATCHES))
    assert negative.remote_first is False
    # The same noise over many more steps tells a real saving apart: remote first.
    clear = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    feed(clear, [(step_s + rng.gauss(0, 0.001), nl, nr, only)
                 for step_s, nl, nr, only in steps(0.030, 0.002, 0.0005,
                                                   (LOCAL_BATCHES + WOVEN_BATCHES) * 5)])
    assert clear.model.contrast_z((0, 0.9, -1), 8) > 2 and clear.remote_first


def test_tries_that_fail_at_one_remote_sequence_double_the_cool_down_until_one_grows():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10, cooldown_s=5.0))
    now = 0.0
    cooldowns = []
    for _ in range(6):  # one remote sequence puts the cold over its budget, every try
        placement.observe_step(0.040, 4, 1)
        placement.observe_pair(PairLoad(cold_inflation=1.25))
        assert placement.update(now) and not placement.is_open
        cooldowns.append(placement.cooldown_s())
        assert f"tries again in {cooldowns[-1]:.0f} s" in placement.reason
        placement.observe_pair(PairLoad(cold_inflation=1.0))
        assert not placement.update(now + cooldowns[-1] - 0.1)  # still cooling down
        now += cooldowns[-1] + 0.1
        assert placement.update(now) and placement.remote_cap == 1
        now += COLD_CUT_HOLD_S + 1
    # The first step-aside is no failed retry; then 2x, 4x, 8x, and no more.
    assert cooldowns == [5.0, 10.0, 20.0, 40.0, 40.0, 40.0]
    assert placement.report()["failed_tries_in_a_row"] == 5
    # A try whose cap grows past one (the cold has room, woven steps well under the
    # target) resets the doubling: the next step-aside cools down for the plain time.
    placement.targets = AdaptiveTargets(hot_tpot_s=0.050, cold_budget=1.10, cooldown_s=5.0)
    _, changes = feed(placement, [(0.030, 4, 1, True)] * 60, start=now)
    assert changes == [] and placement.remote_cap >= 2
    placement.observe_step(0.040, 4, 1)
    placement.observe_pair(PairLoad(cold_inflation=1.25))
    placement.remote_cap = 1
    assert placement.update(now + 100) and placement.cooldown_s() == 5.0


def test_woven_steps_over_the_target_cap_the_remote_sequences_then_the_cap_grows_back():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050))
    feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES))
    # A compute-bound batch: 4 local + 8 remote take 70 ms, over the 50 ms target.
    _, changes = feed(placement, [(0.070, 4, 8, True)] * 60, start=2.0)
    assert changes == [] and placement.is_open
    assert placement.remote_cap == 6  # 3/4 of the 8 running
    assert placement.order(4, 6) == [Placement.LOCAL]  # full: new requests wait
    assert placement.order(4, 5) == BOTH
    # At the cap, woven steps well under the target: one more each update.
    feed(placement, [(0.040, 4, 6, True)] * 60, start=10.0)
    assert placement.remote_cap > 6


def test_the_cap_holds_while_the_cold_model_nears_its_budget_and_grows_once_it_has_room():
    """Grown up to the budget, the cap hovers over it between cuts (two hots into one
    cold ran it at x1.128 against x1.10): past half the budget's growth it holds."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050, cold_budget=1.10))
    feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES))
    # Nothing capped yet, woven steps well under the target, the cold model at x1.07:
    # the cap is set where the remote sequences are, and holds there.
    placement.observe_pair(PairLoad(cold_inflation=1.07))
    _, changes = feed(placement, [(0.030, 4, 5, True)] * 60, start=2.0)
    assert changes == [] and placement.is_open and placement.remote_cap == 5
    assert "near its budget" in placement.reason
    feed(placement, [(0.030, 4, 5, True)] * 60, start=10.0)
    assert placement.remote_cap == 5
    placement.observe_pair(PairLoad(cold_inflation=1.03))  # room again: one more an update
    feed(placement, [(0.030, 4, 5, True)] * 60, start=20.0)
    assert placement.remote_cap > 5


def test_a_cap_that_falls_to_zero_steps_aside_then_resumes_with_one():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050, cooldown_s=5.0))
    now, changes = feed(placement, [(0.080, 4, 1, True)] * 60)
    assert changes and not placement.is_open and placement.order(4, 0) == [Placement.LOCAL]
    assert "TPOT target" in placement.reason and placement.num_step_asides == 1
    assert not placement.update(now + 1.0)  # the cool-down
    assert placement.update(now + 5.1) and placement.is_open and placement.remote_cap == 1


def test_a_burst_of_slow_steps_shorter_than_a_decode_is_not_a_tpot():
    """A burst of arrivals whose prompts lengthen a few seconds of steps: the mean a
    sequence's TPOT takes (about 100 steps) stays under the target, so nothing is cut (a
    cut would make the next arrivals queue)."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    burst = [(0.040, 4, 4, True)] * 100 + [(0.120, 4, 4, False)] * 15
    _, changes = feed(placement, burst + [(0.040, 4, 4, True)] * 30)
    assert changes == [] and placement.remote_cap is None


def test_one_slow_prompt_step_is_not_a_tpot():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050))
    # 200 ms once, then 40 ms steps: over any 20 steps the mean is under 50 ms.
    _, changes = feed(placement, [(0.200, 4, 2, False)] + steps(0.024, 0.002, 0.004,
                                                                 [(4, 2)] * 25))
    assert changes == [] and placement.remote_cap is None


def test_prompt_chunks_do_not_enter_the_step_time_model():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES + WOVEN_BATCHES,
                          decode_only=False))
    assert placement.model.coefficients(placement.targets.min_samples) is None


def test_the_default_hot_target_is_relative_to_local_only_steps():
    placement = AdaptivePlacement(AdaptiveTargets(hot_budget=1.25))
    assert placement.hot_tpot_target_s is None
    feed(placement, [(0.040, 4, 0, True)] * 100)
    assert placement.hot_tpot_target_s == pytest.approx(0.050)


def test_a_spent_cold_budget_cuts_the_remote_sequences_once_per_cold_window():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10, cooldown_s=5.0))
    feed(placement, [(0.040, 4, 8, True)] * 5)
    placement.observe_pair(PairLoad(cold_inflation=1.12))
    assert not placement.update(1.0) and placement.is_open
    # The share that brings x1.12 to x1.05 if each costs the same: 5/12 of the 8.
    assert placement.remote_cap == 3 and "budget" in placement.reason
    # Still over budget, but the cold side has not measured the smaller batch yet.
    feed(placement, [(0.040, 4, 3, True)] * 5, start=1.0)
    assert placement.remote_cap == 3
    placement.observe_step(0.040, 4, 3)
    assert not placement.update(1.0 + COLD_CUT_HOLD_S + 0.1) and placement.remote_cap == 1


@pytest.mark.parametrize(("inflation", "kept"), [(1.101, 3), (1.12, 3), (1.5, 2), (3.0, 2)])
def test_a_cold_cut_keeps_what_brings_the_cold_back_within_a_quarter_to_three_quarters(
        inflation, kept):
    """A reading just over the budget costs at most 3/4 of them (noise), one far over it at
    least 1/4 (back in one or two windows, not six 3/4 cuts)."""
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    feed(placement, [(0.040, 4, 8, True)] * 30)
    placement.observe_pair(PairLoad(cold_inflation=inflation))
    placement.update(5.0)
    assert placement.remote_cap == kept


def test_a_cold_over_its_budget_for_a_window_gives_its_remote_sequences_back():
    """A cut acts on new sequences only; those running remote would go on for a minute on
    this CPU. A cold still over its budget a window after it went over (the cut was not
    enough) sheds the ones over what a cut keeps, then not again for a window; a cold
    within its budget, or with none running, sheds nothing; a reading within the budget
    starts the wait again (a lone spike sheds nothing)."""
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    placement.observe_pair(PairLoad.of_colds([{"cold_inflation": 1.12}, {"cold_inflation": 1.04},
                                              {"cold_inflation": 1.5}, None]))
    assert placement.shed_for_cold([8, 8, 0, 3], now=0.0) == [0, 0, 0, 0]  # just went over
    assert placement.shed_for_cold([8, 8, 0, 3], now=COLD_CUT_HOLD_S) == [5, 0, 0, 0]
    assert placement.shed_for_cold([3, 8, 4, 3], now=COLD_CUT_HOLD_S + 1) == [0, 0, 3, 0]
    assert placement.shed_for_cold([3, 8, 1, 3], now=COLD_CUT_HOLD_S + 2) == [0, 0, 0, 0]
    assert placement.shed_for_cold([3, 8, 1, 3], now=2 * COLD_CUT_HOLD_S) == [2, 0, 0, 0]
    assert placement.report()["cold_budget_preemptions"] == [7, 0, 3, 0]
    spike = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    spike.observe_pair(PairLoad(cold_inflation=1.3))  # one cold, read without its list
    assert spike.shed_for_cold([1], now=0.0) == [0]
    spike.observe_pair(PairLoad(cold_inflation=1.05))
    assert spike.shed_for_cold([1], now=3.0) == [0]
    spike.observe_pair(PairLoad(cold_inflation=1.3))
    assert spike.shed_for_cold([1], now=4.0) == [0]
    assert spike.shed_for_cold([1], now=4.0 + COLD_CUT_HOLD_S) == [1]  # one is all of them


def test_while_the_cold_pays_measurably_the_cap_grows_once_per_cold_window():
    """Grown once an update, the cap let a window's worth of sequences in before the cold
    side had measured the first of them."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050, cold_budget=1.10))
    feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES))
    feed(placement, [(0.070, 4, 8, True)] * 60, start=2.0)  # over the target: cut to 6
    assert placement.remote_cap == 6
    placement.observe_pair(PairLoad(cold_inflation=1.03))  # room, but it shows
    feed(placement, [(0.030, 4, 6, True)] * 50, start=10.0)  # 5 s of updates
    assert placement.remote_cap == 7
    placement.observe_pair(PairLoad(cold_inflation=1.0))  # idle or paying nothing
    # At the cap each update (new sequences fill it): one more an update again.
    feed(placement, [(0.030, 4, 7 + i, True) for i in range(5)], start=30.0)
    assert placement.remote_cap == 12


def test_a_cut_never_raises_the_cap_when_more_run_remote_than_it_allows():
    """Sequences admitted before the cap was set run on over it: a cut for the cold budget
    takes 3/4 of the cap then, not of them (it raised a cap of 12 to 16 with 21 running)."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050, cold_budget=1.10))
    feed(placement, steps(0.030, 0.002, 0.004, LOCAL_BATCHES))
    feed(placement, [(0.070, 4, 16, True)] * 60, start=2.0)  # over the TPOT target
    assert placement.remote_cap == 12
    feed(placement, [(0.045, 4, 21, True)] * 5, start=10.0)  # 21 admitted before the cap
    placement.observe_pair(PairLoad(cold_inflation=1.12))
    placement.update(20.0)
    assert placement.remote_cap == 5  # 5/12 of the cap


def test_a_cold_cut_takes_the_recent_batch_not_a_step_that_ran_few_remote():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    feed(placement, [(0.040, 4, 8, True)] * 30)
    placement.observe_step(0.040, 4, 1)  # a step that ran one remote sequence
    placement.observe_pair(PairLoad(cold_inflation=1.12))
    assert not placement.update(5.0) and placement.is_open
    assert placement.remote_cap == 3  # 5/12 of the 8 the cold side's window measured


def test_a_spent_cold_budget_with_one_remote_sequence_steps_aside_and_holds_while_spent():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10, cooldown_s=5.0))
    placement.observe_step(0.040, 4, 1)
    placement.observe_pair(PairLoad(cold_inflation=1.25))
    assert placement.update(0.0) and not placement.is_open
    assert "budget" in placement.reason and placement.num_step_asides == 1
    assert not placement.update(10.0)  # cooled down, but the cold model is still slowed
    placement.observe_pair(PairLoad(cold_inflation=1.08))  # within, but at the budget's edge
    assert not placement.update(10.2)
    placement.observe_pair(PairLoad(cold_inflation=1.02))
    assert placement.update(10.5) and placement.is_open and placement.remote_cap == 1


def test_a_cold_budget_is_not_cut_for_when_nothing_runs_remote():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    placement.observe_step(0.040, 4, 0)
    placement.observe_pair(PairLoad(cold_inflation=1.25))  # a window that saw older tasks
    assert not placement.update(0.0) and placement.is_open and placement.remote_cap is None


def test_targets_and_ratios_are_checked():
    with pytest.raises(ValueError, match="'auto' or a number"):
        placement_for("half")
    assert isinstance(placement_for(0.5), RatioPlacement)
    with pytest.raises(ValueError, match=">= 1"):
        AdaptiveTargets(cold_budget=0.9)
    with pytest.raises(ValueError, match="> 0"):
        AdaptiveTargets(hot_tpot_s=0)


def test_the_schedulers_feed_times_steps_and_reads_the_pair_every_interval(monkeypatch):
    from weaver.weaving import placement_feed
    from weaver.weaving.placement_feed import PAIR_LOAD_INTERVAL_S, PlacementFeed

    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    feed = PlacementFeed(placement, "hot")
    reads, warnings = [], []
    # The module's own logger: the suite's logging set-up may stop it propagating to caplog.
    monkeypatch.setattr(placement_feed.logger, "warning",
                        lambda message, *args: warnings.append(message % args))

    def read(report):
        reads.append(report["policy"])
        if len(reads) == 2:
            raise TimeoutError("the worker did not answer")
        return [{"cold_inflation": 1.3, "offload_wait_s": 0.002}]  # one pair's

    feed.step_ended(4, 1, True, now=1.0)  # no step was started: nothing to observe
    assert placement.model.samples == deque()
    feed.step_starts(now=0.0)  # before the reader is connected: the policy decides alone
    feed.read_pair_load = read
    feed.step_ended(4, 1, True, now=0.05)
    assert list(placement.model.samples) == [(4, 1, pytest.approx(0.05))]
    feed.step_starts(now=0.1)  # within the interval: no read
    assert reads == []
    feed.step_starts(now=PAIR_LOAD_INTERVAL_S)
    assert reads == ["auto"] and placement.load.cold_inflation == 1.3
    assert placement.remote_cap == 0 and not placement.is_open  # 1 remote, over budget
    feed.step_starts(now=2 * PAIR_LOAD_INTERVAL_S)  # a failed read keeps the last view
    assert len(reads) == 2 and placement.load.cold_inflation == 1.3
    assert any("unavailable" in text for text in warnings)


def test_the_feed_logs_a_cut_of_the_remote_cap_but_not_its_growth(monkeypatch):
    from weaver.weaving import placement_feed
    from weaver.weaving.placement_feed import PAIR_LOAD_INTERVAL_S, PlacementFeed

    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050, min_tpot_samples=2))
    feed = PlacementFeed(placement, "hot")
    said = []
    monkeypatch.setattr(placement_feed.logger, "info",
                        lambda message, *args: said.append(message % args))
    for step in range(3):  # woven steps over the target: the cap is cut to 3/4 of 4
        feed.step_starts(now=step * PAIR_LOAD_INTERVAL_S)
        feed.step_ended(2, 4, True, now=step * PAIR_LOAD_INTERVAL_S + 0.080)
    feed.step_starts(now=3 * PAIR_LOAD_INTERVAL_S)
    assert placement.remote_cap == 3
    assert said == ["weaving hot: weaving: at most 3 remote sequences (woven hot steps take "
                    "80.0 ms on average, over the TPOT target 50.0 ms)"]
    for step in range(4, 10):  # fast steps at the cap: it grows, one by one, unlogged
        feed.step_starts(now=step * PAIR_LOAD_INTERVAL_S)
        feed.step_ended(2, 3, True, now=step * PAIR_LOAD_INTERVAL_S + 0.010)
    assert placement.remote_cap > 3 and len(said) == 1


def test_several_colds_the_best_ones_factor_drives_the_cap_and_one_over_budget_takes_none():
    load = PairLoad.of_colds([{"cold_inflation": 1.25, "offload_wait_s": 0.004}, None,
                              {"cold_inflation": 1.05, "offload_wait_s": 0.002}])
    assert load.cold_inflation == 1.05 and load.offload_wait_s == pytest.approx(0.003)
    assert load.cold_inflations == (1.25, None, 1.05)
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10))
    placement.observe_step(0.05, 4, 2)
    placement.observe_pair(load)
    assert not placement.update(now=1.0) and placement.remote_cap is None  # one is within
    assert [placement.cold_is_open(i) for i in range(3)] == [False, True, True]
    assert PairLoad.of_colds([None]) == PairLoad(cold_inflations=(None,))


def test_a_remote_sequence_goes_to_the_open_cold_with_most_free_blocks():
    assert cold_order([3, 9, 9, 20], [True, True, True, False]) == [1, 2, 0]
    assert cold_order([0, 4], [True, True]) == [1]  # a full cold is not tried
    assert cold_order([5, 5], [False, False]) == []
    assert RatioPlacement(0.5).cold_is_open(7)


def feed_finishing(placement: AdaptivePlacement, num_output_tokens: int, num_remote: int,
                   num_cycles: int):
    """Cycles of 14 decode steps (30 ms) and a burst of 4 prompt steps (140 ms): their
    mean, 54 ms, is under a 60 ms target. After each step a sequence of
    `num_output_tokens` finishes; update() every 5 steps. The (time, is_open) changes."""
    cycle = [(0.030, True)] * 14 + [(0.140, False)] * 4
    now, changes = 0.0, []
    for index, (step_s, decode_only) in enumerate(cycle * num_cycles):
        placement.observe_step(step_s, 4, num_remote, decode_only)
        placement.observe_finished(num_output_tokens)
        now += step_s
        if index % 5 == 4 and placement.update(now):
            changes.append((now, placement.is_open))
    return changes


def test_short_sequences_over_the_slo_beside_remote_ones_step_weaving_aside():
    """Short sequences decoding through a burst of prompt chunks ran at the prompt steps'
    time (the regime map's Azure-code cells: 20 % of the requests over the SLO's TPOT
    while the woven steps' mean stayed under its target): weaving steps aside, though the
    mean is within the target."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    changes = feed_finishing(placement, num_output_tokens=5, num_remote=4, num_cycles=8)
    assert changes and not placement.is_open and placement.order(4, 0) == [Placement.LOCAL]
    assert "SLO's TPOT 70.6 ms" in placement.reason and placement.num_step_asides == 1
    assert placement.report()["hot_woven_step_s"] < 0.060


def test_long_sequences_through_the_same_bursts_keep_weaving():
    """The same steps, sequences of 100 tokens: each one's TPOT is the steps' mean."""
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    assert feed_finishing(placement, num_output_tokens=100, num_remote=4, num_cycles=12) == []
    assert placement.is_open and placement.report()["tpot_over_slo_share"] == 0.0


def test_sequences_that_decoded_beside_no_remote_one_are_not_weavings_to_answer_for():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    assert feed_finishing(placement, num_output_tokens=5, num_remote=0, num_cycles=8) == []
    assert placement.is_open and placement.report()["tpot_over_slo_share"] is None


def test_a_sequence_is_judged_on_its_own_steps_and_only_after_the_last_restart():
    tail = TpotTail()
    for step_s, is_woven in [(0.010, False), (0.020, True), (0.040, False), (0.060, False)]:
        tail.add_step(step_s, is_woven)
    tail.add_finished(4)  # decoded over the last 3 steps, one of them woven
    tail.add_finished(3)  # the last 2, neither woven
    tail.add_finished(1)  # no decode step
    assert tail.tpots_s == [pytest.approx(0.040)]
    tail.restart()
    tail.add_step(0.050, True)
    tail.add_finished(3)  # it started decoding before the restart
    tail.add_finished(2)
    assert tail.tpots_s == [pytest.approx(0.050)] and tail.share_over(0.045) is None
