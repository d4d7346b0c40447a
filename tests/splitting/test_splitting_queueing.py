"""The polling-system wait model (weaver/splitting/queueing.py), by hand and by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weaver.splitting.queueing import (
    expected_residual,
    expected_stall,
    expected_wait,
    queueing_delay,
    residual_cdf,
    residual_quantile,
)

op_lists = st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=12)


def test_wait_hand_computed_mixed_ops():
    # (1 + 1 + 4) / (2 * 4)
    assert expected_wait([1.0, 1.0, 2.0]) == pytest.approx(0.75)


def test_wait_single_op_is_half_its_time():
    assert expected_wait([3.0]) == pytest.approx(1.5)


def test_wait_equal_ops_is_half_one_op():
    assert expected_wait([0.2] * 7) == pytest.approx(0.1)


def test_long_operator_counts_quadratically():
    # Same total time 4: one op of 4 waits twice as long as two ops of 2.
    assert expected_wait([4.0]) == pytest.approx(2 * expected_wait([2.0, 2.0]))


def test_counts_equal_repetition():
    assert expected_residual([1.0, 3.0], [5, 2]) == pytest.approx(
        expected_residual([1.0] * 5 + [3.0] * 2)
    )


def test_zero_time_op_is_never_hit():
    assert expected_wait([1.0, 0.0, 2.0]) == pytest.approx(expected_wait([1.0, 2.0]))


def test_wait_with_queueing_hand_computed():
    # residual 2/2 = 1; rho = 0.25 * 2 = 0.5; queue = 0.25 * 4 / (2 * 0.5) = 1
    assert queueing_delay(0.25, 2.0) == pytest.approx(1.0)
    assert expected_wait([2.0], arrival_rate=0.25, service_time=2.0) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("op_times", "counts", "message"),
    [
        ([], None, "empty"),
        ([1.0, -1.0], None, ">= 0"),
        ([math.nan], None, "finite"),
        ([0.0, 0.0], None, "no time"),
        ([1.0], [1, 2], "one count per operator"),
        ([1.0], [1.5], "integer"),
    ],
)
def test_bad_op_times_raise(op_times, counts, message):
    with pytest.raises(ValueError, match=message):
        expected_wait(op_times, counts)


def test_unstable_queue_raises_with_advice():
    with pytest.raises(ValueError, match="offload fewer"):
        expected_wait([1.0], arrival_rate=1.0, service_time=1.0)


def test_quantile_hand_computed():
    # F(r) = 3r/4 on [0, 1] and (2 + r)/4 on [1, 2].
    ops = [1.0, 1.0, 2.0]
    assert residual_quantile(0.0, ops) == 0.0
    assert residual_quantile(0.5, ops) == pytest.approx(2 / 3)
    assert residual_quantile(0.75, ops) == pytest.approx(1.0)
    assert residual_quantile(0.9, ops) == pytest.approx(1.6)
    assert residual_quantile(1.0, ops) == pytest.approx(2.0)
    assert residual_cdf(1.6, ops) == pytest.approx(0.9)


def test_quantile_rejects_bad_q():
    with pytest.raises(ValueError, match="0.99 for p99"):
        residual_quantile(99, [1.0])


@given(op_lists, st.floats(0.0, 1.0))
def test_quantile_inverts_cdf(ops, q):
    r = residual_quantile(q, ops)
    assert 0.0 <= r <= max(ops) + 1e-12
    assert residual_cdf(r, ops) == pytest.approx(q, abs=1e-9)


def test_stall_hand_computed():
    ops = [1.0, 1.0, 2.0]
    assert expected_stall(ops, slack_s=1.0) == pytest.approx(1 / 8)  # only the 2 s op
    assert expected_stall(ops, slack_s=0.0) == pytest.approx(expected_wait(ops))
    assert expected_stall(ops, slack_s=-0.5) == pytest.approx(expected_wait(ops) + 0.5)
    assert expected_stall(ops, slack_s=2.0) == 0.0


def _sample_residuals(ops: list[float], num_samples: int, seed: int) -> np.ndarray:
    """Drop arrivals uniformly on the cyclic cold timeline; time to the end of the op hit."""
    ends = np.cumsum(ops)
    arrivals = np.random.default_rng(seed).uniform(0.0, ends[-1], num_samples)
    return ends[np.searchsorted(ends, arrivals, side="right")] - arrivals


def test_residual_formulas_match_sampling():
    ops = [0.3, 1.0, 0.1, 2.5, 0.7]
    residuals = _sample_residuals(ops, 400_000, seed=0)
    assert residuals.mean() == pytest.approx(expected_residual(ops), rel=0.01)
    assert np.quantile(residuals, 0.99) == pytest.approx(residual_quantile(0.99, ops), rel=0.01)
    stall = np.maximum(0.0, residuals - 0.4).mean()
    assert stall == pytest.approx(expected_stall(ops, slack_s=0.4), rel=0.01)


def _simulate_polling(ops, arrival_rate, service, num_tasks, seed) -> float:
    """Cold ops run cyclically; at each op end every pending task is served in turn."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / arrival_rate, num_tasks))
    now, op_index, task, total_wait = 0.0, 0, 0, 0.0
    while task < num_tasks:
        now += ops[op_index % len(ops)]
        op_index += 1
        while task < num_tasks and arrivals[task] <= now:  # exhaustive service at a poll
            total_wait += now - arrivals[task]
            now += service
            task += 1
    return total_wait / num_tasks


def test_queueing_formula_matches_simulation():
    # The M/G/1-with-vacations form treats the cyclic schedule as i.i.d. vacations; a
    # discrete-event run of the real cyclic schedule agrees within 2 %.
    ops, rate, service = [0.2, 1.0, 0.5, 0.3], 0.4, 0.8
    simulated = _simulate_polling(ops, rate, service, 60_000, seed=1)
    predicted = expected_wait(ops, arrival_rate=rate, service_time=service)
    assert simulated == pytest.approx(predicted, rel=0.02)
    assert predicted > expected_residual(ops) * 1.2  # the queue term is not negligible here
