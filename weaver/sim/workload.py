"""A small local request generator: Poisson arrivals, lognormal lengths, power-law rates.

Stands in until the trace loaders of `weaver.workloads` are plugged in; the simulator
accepts any iterable of `TraceRequest`, so a real trace replaces this without changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from weaver.workloads.types import TraceRequest


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, num: int,
                      low: int = 1, high: int = 1 << 20) -> np.ndarray:
    """Integer lengths from a lognormal with the given mean (mu = ln(mean) - sigma^2/2)."""
    if mean <= 0 or sigma < 0:
        raise ValueError(f"length distribution needs mean > 0 and sigma >= 0, got "
                         f"mean={mean}, sigma={sigma}")
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, num)), low, high).astype(int)


def poisson_requests(model: str, rate: float, duration_s: float, input_mean: float,
                     output_mean: float, sigma: float = 1.0, seed: int = 0,
                     max_input: int = 1 << 20, max_output: int = 1 << 20
                     ) -> list[TraceRequest]:
    """Requests of one model arriving as a Poisson process of `rate` per second."""
    if rate < 0 or duration_s <= 0:
        raise ValueError(f"need rate >= 0 and duration_s > 0, got {rate}, {duration_s}")
    rng = np.random.default_rng(seed)
    if rate == 0:
        return []
    num = rng.poisson(rate * duration_s)
    arrivals = np.sort(rng.uniform(0.0, duration_s, num))
    inputs = lognormal_lengths(rng, input_mean, sigma, num, high=max_input)
    outputs = lognormal_lengths(rng, output_mean, sigma, num, high=max_output)
    return [TraceRequest(float(a), int(i), int(o), model) for a, i, o in
            zip(arrivals, inputs, outputs, strict=True)]


def power_law_rates(num_models: int, total_rate: float, alpha: float) -> list[float]:
    """Rates proportional to rank^-alpha (MuxServe §5.1 popularity), summing to total."""
    weights = [(rank + 1) ** -alpha for rank in range(num_models)]
    scale = total_rate / sum(weights)
    return [w * scale for w in weights]


def merge_by_arrival(*streams: list[TraceRequest]) -> Iterator[TraceRequest]:
    """All requests in arrival order with request ids renumbered from 0."""
    merged = sorted((r for s in streams for r in s), key=lambda r: (r.arrival_s, r.model))
    for i, r in enumerate(merged):
        yield TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens, r.model, i)
