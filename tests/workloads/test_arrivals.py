"""Arrival processes, length scaling and power-law popularity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weaver.workloads.arrivals import gamma_arrivals, poisson_arrivals, trace_arrivals, trace_rate
from weaver.workloads.lengths import scale_lengths
from weaver.workloads.popularity import power_law_rates, split_count


def _gaps(times):
    return np.diff(np.concatenate([[0.0], times]))


def test_poisson_mean_rate_and_exponential_gaps():
    n, rate = 20_000, 5.0
    times = poisson_arrivals(n, rate, np.random.default_rng(1))
    gaps = _gaps(times)
    # Mean of n exponential gaps: sd = (1/rate)/sqrt(n) = 0.7% of the mean; allow ~4 sd.
    assert n / times[-1] == pytest.approx(rate, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)
    assert np.all(gaps > 0)


def test_arrivals_deterministic_by_seed():
    a = poisson_arrivals(100, 2.0, np.random.default_rng(7))
    b = poisson_arrivals(100, 2.0, np.random.default_rng(7))
    c = poisson_arrivals(100, 2.0, np.random.default_rng(8))
    assert a == b
    assert a != c
    g1 = gamma_arrivals(100, 2.0, 0.5, np.random.default_rng(7))
    assert g1 == gamma_arrivals(100, 2.0, 0.5, np.random.default_rng(7))


def test_gamma_keeps_rate_and_cv_grows_as_burstiness_falls():
    n, rate = 20_000, 4.0
    cvs = []
    for burstiness in (4.0, 1.0, 0.25):
        times = gamma_arrivals(n, rate, burstiness, np.random.default_rng(3))
        gaps = _gaps(times)
        assert n / times[-1] == pytest.approx(rate, rel=0.05)
        cv = float(np.std(gaps) / np.mean(gaps))
        assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)
        cvs.append(cv)
    assert cvs[0] < cvs[1] < cvs[2]


def test_trace_arrivals_scaled():
    stamps = [10.0, 11.0, 13.0, 17.0]
    assert trace_arrivals(stamps) == [0.0, 1.0, 3.0, 7.0]
    assert trace_arrivals(stamps, 0.5) == [0.0, 0.5, 1.5, 3.5]
    assert trace_rate(stamps) == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="not sorted"):
        trace_arrivals([1.0, 0.0])
    with pytest.raises(ValueError, match="positive"):
        trace_arrivals(stamps, 0.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [((10, 0.0), "rate"), ((-1, 1.0), "num_requests"), ((10, float("inf")), "rate")],
)
def test_bad_arrival_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        poisson_arrivals(*args, np.random.default_rng(0))
    with pytest.raises(ValueError, match=message):
        gamma_arrivals(*args, 1.0, np.random.default_rng(0))


def test_gamma_rejects_bad_burstiness():
    with pytest.raises(ValueError, match="burstiness"):
        gamma_arrivals(10, 1.0, 0.0, np.random.default_rng(0))


def test_scale_lengths():
    assert scale_lengths(1000, 200, 0.1) == (100, 20)
    assert scale_lengths(3, 2, 0.1) == (1, 1)  # never below one token each
    num_in, num_out = scale_lengths(1500, 499, 0.5, max_model_len=512)
    assert num_in + num_out <= 512
    assert num_in / num_out == pytest.approx(1500 / 499, rel=0.05)  # mix kept
    assert scale_lengths(10, 1000, 1.0, max_model_len=64)[0] >= 1
    assert sum(scale_lengths(10, 1000, 1.0, max_model_len=64)) <= 64
    with pytest.raises(ValueError, match="factor"):
        scale_lengths(1, 1, 0)
    with pytest.raises(ValueError, match="max_model_len"):
        scale_lengths(1, 1, 1.0, max_model_len=1)


def test_power_law_rates():
    rates = power_law_rates(4, 10.0, 1.0)
    assert sum(rates) == pytest.approx(10.0)
    for i, r in enumerate(rates):
        assert r / rates[0] == pytest.approx((i + 1) ** -1.0)
    assert power_law_rates(3, 6.0, 0.0) == pytest.approx([2.0, 2.0, 2.0])
    steep = power_law_rates(3, 6.0, 2.1)
    assert steep[0] / sum(steep) > 0.7
    with pytest.raises(ValueError, match="alpha"):
        power_law_rates(3, 1.0, -1.0)
    with pytest.raises(ValueError, match="at least one"):
        power_law_rates(0, 1.0, 1.0)


def test_split_count_sums_exactly():
    assert split_count(10, [1, 1, 1]) == [4, 3, 3]
    assert split_count(7, [5.0, 2.0]) == [5, 2]
    assert sum(split_count(1001, power_law_rates(5, 3.0, 0.9))) == 1001
    with pytest.raises(ValueError, match="weights"):
        split_count(3, [0, 0])


@settings(max_examples=200, deadline=None)
@given(
    num_in=st.integers(0, 20_000),
    num_out=st.integers(0, 5_000),
    factor=st.floats(0.001, 4.0),
    max_len=st.one_of(st.none(), st.integers(2, 4096)),
)
def test_scale_lengths_always_fits(num_in, num_out, factor, max_len):
    new_in, new_out = scale_lengths(num_in, num_out, factor, max_len)
    assert new_in >= 1 and new_out >= 1
    if max_len is not None:
        assert new_in + new_out <= max_len


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(0, 10_000),
    weights=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
)
def test_split_count_is_exact_and_close(total, weights):
    counts = split_count(total, weights)
    assert sum(counts) == total
    for count, weight in zip(counts, weights, strict=True):
        assert abs(count - total * weight / sum(weights)) < 1.0 + 1e-9
