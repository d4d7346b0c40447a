"""Reading a histogram or a counter back from /metrics text (weaver/bench/prom_histogram.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from weaver.bench.prom_histogram import read_counter, read_histogram


def _text(observations: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    hist = Histogram("weaver_offload_wait_seconds", "wait", ["hot", "cold"],
                     buckets=(0.001, 0.002, 0.004), registry=registry)
    for cold, values in observations.items():
        for value in values:
            hist.labels(hot="h", cold=cold).observe(value)
    return generate_latest(registry).decode()


def test_mean_and_quantiles_from_buckets():
    text = _text({"c": [0.0005] * 50 + [0.0015] * 40 + [0.003] * 10})
    reading = read_histogram(text, "weaver_offload_wait_seconds", {"cold": "c"})
    assert reading.count == 100
    assert reading.mean == pytest.approx((50 * 0.0005 + 40 * 0.0015 + 10 * 0.003) / 100)
    # rank 50 is the top of the first bucket; rank 70 is halfway through the second;
    # rank 99 is 90 % of the way through the third (0.002 .. 0.004).
    assert reading.quantile(0.5) == pytest.approx(0.001)
    assert reading.quantile(0.7) == pytest.approx(0.0015)
    assert reading.quantile(0.99) == pytest.approx(0.002 + 0.9 * 0.002)


def test_labels_select_and_other_labels_sum():
    text = _text({"a": [0.0005] * 3, "b": [0.003] * 1})
    assert read_histogram(text, "weaver_offload_wait_seconds", {"cold": "a"}).count == 3
    both = read_histogram(text, "weaver_offload_wait_seconds")
    assert both.count == 4 and both.quantile(1.0) == pytest.approx(0.004)
    assert read_histogram(text, "weaver_offload_wait_seconds", {"cold": "z"}) is None
    assert read_histogram(text, "no_such_histogram") is None


def test_beyond_the_last_bucket_and_empty():
    text = _text({"c": [0.01] * 4})
    reading = read_histogram(text, "weaver_offload_wait_seconds")
    assert reading.quantile(0.5) == pytest.approx(0.004)  # only known to be above it
    empty = _text({})
    assert read_histogram(empty, "weaver_offload_wait_seconds") is None
    with pytest.raises(ValueError, match="quantile"):
        reading.quantile(1.5)


def test_counter_selected_by_labels_and_summed_over_the_rest():
    registry = CollectorRegistry()
    busy = Counter("weaver_offload_cold_busy_seconds", "busy", ["hot", "cold", "where"],
                   registry=registry)
    busy.labels(hot="h", cold="c", where="poll_point").inc(1.5)
    busy.labels(hot="h", cold="c", where="idle").inc(4.0)
    text = generate_latest(registry).decode()
    name = "weaver_offload_cold_busy_seconds"
    assert read_counter(text, name, {"where": "poll_point"}) == pytest.approx(1.5)
    assert read_counter(text, name) == pytest.approx(5.5)
    assert read_counter(text, name, {"where": "elsewhere"}) is None
    assert read_counter(text, "weaver_offload_wait_seconds") is None
