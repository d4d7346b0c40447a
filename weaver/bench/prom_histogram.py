"""A Prometheus histogram (or counter) read back from a server's /metrics text.

Benchmarks that drive `weaver serve` read Weaver's own series (e.g. the hot side's
`weaver_offload_wait_seconds`) to report them beside their client-side figures.
Quantiles come from the cumulative buckets as Prometheus' `histogram_quantile` computes
them: linear inside the bucket that holds the rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class HistogramReading:
    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        if not 0 <= q <= 1:
            raise ValueError(f"quantile {q} must be in [0, 1]")
        if not self.count:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):  # past the last finite bucket: its bound is all we know
                    return lower_bound
                width = cumulative - lower_count
                frac = (rank - lower_count) / width if width else 1.0
                return lower_bound + (bound - lower_bound) * frac
            lower_bound, lower_count = bound, cumulative
        return lower_bound


def read_histogram(metrics_text: str, name: str,
                   labels: dict[str, str] | None = None) -> HistogramReading | None:
    """The histogram ``name`` whose labels include ``labels``, summed over any other
    labels; None when the text has no such series."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    found = False
    for sample in _samples(metrics_text, name, "histogram", labels or {}):
        found = True
        if sample.name == f"{name}_bucket":
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
        elif sample.name == f"{name}_count":
            count += sample.value
        elif sample.name == f"{name}_sum":
            total += sample.value
    if not found:
        return None
    return HistogramReading(count, total, tuple(sorted(buckets.items())))


def read_counter(metrics_text: str, name: str,
                 labels: dict[str, str] | None = None) -> float | None:
    """The counter ``name`` (without its ``_total`` suffix) whose labels include
    ``labels``, summed over any other labels; None when the text has no such series."""
    values = [sample.value for sample in _samples(metrics_text, name, "counter", labels or {})
              if sample.name == f"{name}_total"]
    return sum(values) if values else None


def read_gauge(metrics_text: str, name: str,
               labels: dict[str, str] | None = None) -> float | None:
    """The gauge ``name`` whose labels include ``labels``, summed over any other labels;
    None when the text has no such series."""
    values = [sample.value for sample in _samples(metrics_text, name, "gauge", labels or {})]
    return sum(values) if values else None


def _samples(metrics_text: str, name: str, kind: str,
             labels: dict[str, str]) -> Iterator[Sample]:
    """The samples of the ``kind`` family ``name`` whose labels include ``labels``."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name or family.type != kind:
            continue
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                yield sample
