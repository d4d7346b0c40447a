"""The ADBS turn rule of a colocated group (weaver/mux/turns.py), case by case."""

from __future__ import annotations

from weaver.mux.turns import Kind, Member, Mode, admissible, next_turn

D, P = Kind.DECODE, Kind.PREFILL


def members(*specs: tuple) -> list[Member]:
    return [Member(i, *spec) for i, spec in enumerate(specs)]


def test_temporal_admits_nobody_beside_a_running_step():
    group = members((1.0, 0.0, P, None), (1.0, 0.0, None, D))
    assert admissible(group, Mode.TEMPORAL) == []
    assert next_turn(group, Mode.TEMPORAL, 4) is None


def test_spatial_temporal_admits_only_the_other_kind_of_another_model():
    running_prefill = (1.0, 0.0, None, P)
    group = members(running_prefill, (1.0, 0.0, D, None), (1.0, 0.0, P, None))
    assert [m.index for m in admissible(group, Mode.SPATIAL_TEMPORAL)] == [1]
    assert next_turn(group, Mode.SPATIAL_TEMPORAL, 4) == 1


def test_two_running_steps_admit_nobody():
    group = members((1.0, 0.0, None, P), (1.0, 0.0, None, D), (1.0, 0.0, D, None))
    assert next_turn(group, Mode.SPATIAL_TEMPORAL, 4) is None


def test_prefill_goes_before_a_less_served_decode():
    group = members((1.0, 0.0, D, None), (1.0, 50.0, P, None))
    assert next_turn(group, Mode.TEMPORAL, 4) == 1


def test_decode_goes_to_the_least_service_per_weight():
    # Model 0 served 3 s at rate 4 (0.75 s per unit), model 1 served 1 s at rate 1 (1.0).
    group = members((4.0, 3.0, D, None), (1.0, 1.0, D, None))
    assert next_turn(group, Mode.TEMPORAL, 4) == 0


def test_a_step_skipped_skip_limit_times_goes_first_even_before_a_prefill():
    group = members((1.0, 0.0, P, None), (1.0, 99.0, D, None, 4))
    assert next_turn(group, Mode.TEMPORAL, 4) == 1
    assert next_turn(group, Mode.TEMPORAL, 5) == 0


def test_ties_go_to_the_longest_waiting():
    group = members((1.0, 0.0, D, None, 0, 200), (1.0, 0.0, D, None, 0, 100))
    assert next_turn(group, Mode.TEMPORAL, 4) == 1


def grant_rounds(weights: list[float], kinds_of, num_grants: int, skip_limit: int = 4):
    """Everyone always waits (a backlogged group, temporal mode); each grant runs one
    1-second step. Applies the table's bookkeeping: the winner's service grows, every other
    waiter's skips grow. Returns the grant order and each grant's skips at grant time."""
    served = [0.0] * len(weights)
    skips = [0] * len(weights)
    order, skips_at_grant = [], []
    for step in range(num_grants):
        group = [Member(i, w, served[i], kinds_of(i, step), None, skips[i])
                 for i, w in enumerate(weights)]
        winner = next_turn(group, Mode.TEMPORAL, skip_limit)
        order.append(winner)
        skips_at_grant.append(skips[winner])
        served[winner] += 1.0
        skips = [0 if i == winner else s + 1 for i, s in enumerate(skips)]
    return order, skips_at_grant


def test_backlogged_decodes_share_turns_by_rate():
    order, _ = grant_rounds([3.0, 1.0], lambda i, step: D, 400)
    assert order.count(0) == 300 and order.count(1) == 100


def test_a_stream_of_prefills_does_not_starve_a_decode():
    # Model 0 always has a prompt waiting; model 1 only decodes.
    order, skips_at_grant = grant_rounds([1.0, 1.0], lambda i, step: P if i == 0 else D, 200,
                                         skip_limit=4)
    assert order.count(1) >= 200 // 5
    assert max(skips_at_grant) <= 4
