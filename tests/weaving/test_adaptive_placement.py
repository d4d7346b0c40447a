"""offload_ratio auto (weaver/weaving/placement.py AdaptivePlacement) on sequences of the
inputs the hot scheduler feeds it: step times and batches, KV-capped or not, and the
pair's load. The sequences are synthetic, shaped like the two regimes weaving meets: a
batch capped by KV whose step time barely grows with it (weaving pays), and one whose
step time grows with every sequence (a compute-bound engine: weaving cannot pay)."""

from __future__ import annotations

import pytest

from weaver.weaving.placement import (
    AdaptivePlacement,
    AdaptiveTargets,
    PairLoad,
    Placement,
    RatioPlacement,
    placement_for,
)

BOTH = [Placement.LOCAL, Placement.REMOTE]


def feed(placement: AdaptivePlacement, steps, start: float = 0.0, step_gap: float = 0.1):
    """(step_s, num_local, num_remote, kv_capped) per step; update() after each."""
    now = start
    changes = []
    for step_s, num_local, num_remote, capped in steps:
        placement.observe_step(step_s, num_local, num_remote, capped)
        now += step_gap
        if placement.update(now):
            changes.append((now, placement.is_open))
    return now, changes


def test_auto_is_local_first_and_spills_while_open():
    placement = placement_for("auto")
    assert isinstance(placement, AdaptivePlacement)
    assert placement.order(0, 0) == BOTH
    assert placement.order(5, 3) == BOTH  # never remote first: local while it has room


def test_weaving_that_pays_stays_on():
    # KV-capped at 4 local sequences, 40 ms a step; woven steps of 8 take 46 ms: x1.74 the
    # tokens/s, within a 60 ms target, the cold model at x1.04.
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.060))
    placement.observe_pair(PairLoad(cold_inflation=1.04, offload_wait_s=0.002))
    feed(placement, [(0.040, 4, 0, True)] * 10)
    _, changes = feed(placement, [(0.046, 4, 4, True)] * 30, start=1.0)
    assert changes == [] and placement.is_open
    report = placement.report()
    assert report["weaving_active"] and report["woven_tokens_per_s"] > 1.7 * report[
        "capped_tokens_per_s"]


def test_a_compute_bound_batch_steps_aside_when_woven_steps_serve_no_more_tokens():
    # Step time grows with the batch (10 ms a sequence): 8 sequences take twice as long as
    # 4, so tokens/s stay flat while every token is slower (a loose TPOT target, so the
    # throughput check is what decides).
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=1.0))
    feed(placement, [(0.040, 4, 0, True)] * 10)
    now, changes = feed(placement, [(0.080, 4, 4, True)] * 10, start=1.0)
    assert changes and changes[0][1] is False
    assert not placement.is_open and placement.order(4, 0) == [Placement.LOCAL]
    assert "tokens/s" in placement.reason and placement.num_step_asides == 1
    # It stays aside for the cool-down, then tries again and measures afresh.
    assert not placement.update(now + 1.0)
    assert placement.update(now + placement.targets.cooldown_s + 0.1)
    assert placement.is_open and placement.report()["woven_tokens_per_s"] is None


def test_woven_steps_over_the_hot_tpot_target_step_aside():
    placement = AdaptivePlacement(AdaptiveTargets(hot_tpot_s=0.050))
    feed(placement, [(0.030, 4, 0, True)] * 10)
    _, changes = feed(placement, [(0.055, 4, 6, True)] * 10, start=1.0)
    assert changes and not placement.is_open and "TPOT target" in placement.reason


def test_the_default_hot_target_is_relative_to_local_only_steps():
    placement = AdaptivePlacement(AdaptiveTargets(hot_budget=1.25))
    assert placement.hot_tpot_target_s is None
    feed(placement, [(0.040, 4, 0, False)] * 20)
    assert placement.hot_tpot_target_s == pytest.approx(0.050)


def test_a_spent_cold_budget_steps_aside_at_once_and_holds_while_it_stays_spent():
    placement = AdaptivePlacement(AdaptiveTargets(cold_budget=1.10, cooldown_s=5.0))
    placement.observe_pair(PairLoad(cold_inflation=1.25))
    assert placement.update(0.0) and not placement.is_open
    assert "budget" in placement.reason
    assert not placement.update(10.0)  # cooled down, but the cold model is still slowed
    placement.observe_pair(PairLoad(cold_inflation=1.02))
    assert placement.update(10.5) and placement.is_open


def test_not_kv_capped_steps_give_no_throughput_baseline():
    # An engine that never fills its local pool has no KV-capped steps: nothing to compare,
    # and since the scheduler only goes remote on overflow, nothing goes remote either.
    placement = AdaptivePlacement()
    feed(placement, [(0.040, 3, 0, False)] * 30)
    assert placement.report()["capped_tokens_per_s"] is None and placement.is_open


def test_targets_and_ratios_are_checked():
    with pytest.raises(ValueError, match="'auto' or a number"):
        placement_for("half")
    assert isinstance(placement_for(0.5), RatioPlacement)
    with pytest.raises(ValueError, match=">= 1"):
        AdaptiveTargets(cold_budget=0.9)
    with pytest.raises(ValueError, match="> 0"):
        AdaptiveTargets(hot_tpot_s=0)
