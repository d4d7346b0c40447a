"""Arrival processes: when each request of a workload is sent.

All return sorted offsets in seconds from the workload's start. Randomness comes only from
the `numpy.random.Generator` passed in, so one seed (see `builder.py`) fixes a workload.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check_count_rate(num_requests: int, rate: float) -> None:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"the request rate must be a positive number of req/s, got {rate}")


def poisson_arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> list[float]:
    """A Poisson process at `rate` req/s: exponential gaps of mean 1/rate. The first request
    also waits one gap, as in vLLM's benchmarks/benchmark_serving.py."""
    _check_count_rate(num_requests, rate)
    gaps = rng.exponential(scale=1.0 / rate, size=num_requests)
    return np.cumsum(gaps).tolist()


def gamma_arrivals(
    num_requests: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate, as vLLM's `--burstiness`: shape=burstiness,
    scale=1/(rate*burstiness). Burstiness 1 is Poisson; below 1 is burstier (the gaps' CV is
    1/sqrt(burstiness)); above 1 is more regular."""
    _check_count_rate(num_requests, rate)
    if not burstiness > 0 or not np.isfinite(burstiness):
        raise ValueError(f"burstiness must be a positive number (1.0 = Poisson), got {burstiness}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    return np.cumsum(gaps).tolist()


def phased(times_s: Sequence[float], on_s: float, off_s: float) -> list[float]:
    """Arrivals drawn at a model's rate moved into on/off phases: each `on_s` of arrivals
    keeps its times inside an on phase, then `off_s` passes with none (the first phase is
    on). The rate while on stays the one drawn at; over a cycle it is on/(on+off) of it.
    A benchmark interleaves a model's load with its absence this way, to compare another
    model's latency with and without it in one sitting."""
    if not on_s > 0 or not off_s >= 0 or not np.isfinite(on_s + off_s):
        raise ValueError(f"phases need on > 0 s and off >= 0 s, got on={on_s} off={off_s}")
    stamps = np.asarray(times_s, dtype=float)
    return (np.floor(stamps / on_s) * (on_s + off_s) + np.mod(stamps, on_s)).tolist()


def trace_arrivals(timestamps_s: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """The trace's own timestamps, made relative to the first and multiplied by
    `time_scale` (0.5 replays twice as fast, 2.0 half as fast)."""
    if not time_scale > 0 or not np.isfinite(time_scale):
        raise ValueError(f"time_scale must be a positive factor, got {time_scale}")
    if len(timestamps_s) == 0:
        return []
    stamps = np.asarray(timestamps_s, dtype=float)
    if np.any(np.diff(stamps) < 0):
        raise ValueError("trace timestamps are not sorted; sort the rows by time first")
    return ((stamps - stamps[0]) * time_scale).tolist()


def trace_rate(timestamps_s: Sequence[float]) -> float:
    """Mean arrival rate of a trace in req/s: (n - 1) gaps over its span."""
    if len(timestamps_s) < 2 or timestamps_s[-1] <= timestamps_s[0]:
        raise ValueError("a trace rate needs at least two rows with distinct timestamps")
    return (len(timestamps_s) - 1) / (timestamps_s[-1] - timestamps_s[0])
