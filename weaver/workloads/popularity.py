"""Per-model request rates for multi-model workloads.

MuxServe (Duan et al., ICML 2024, Sec. 5) draws model popularity from a power law: the i-th
most popular of m models gets a rate proportional to i^-alpha, scaled to a total rate.
"""

from __future__ import annotations

from collections.abc import Sequence


def power_law_rates(num_models: int, total_rate: float, alpha: float) -> list[float]:
    """Rates r_i = total_rate * i^-alpha / sum_j j^-alpha for i = 1..num_models (alpha 0 is
    an even split; larger alpha concentrates load on the first model)."""
    if num_models < 1:
        raise ValueError(f"need at least one model, got {num_models}")
    if not total_rate > 0:
        raise ValueError(f"total rate must be > 0 req/s, got {total_rate}")
    if alpha < 0:
        raise ValueError(f"power-law alpha must be >= 0, got {alpha}")
    weights = [(i + 1) ** -alpha for i in range(num_models)]
    norm = sum(weights)
    return [total_rate * w / norm for w in weights]


def split_count(num_total: int, weights: Sequence[float]) -> list[int]:
    """Split `num_total` requests in proportion to `weights`, summing exactly to the total
    (largest-remainder rounding, ties to the earlier entry)."""
    if num_total < 0:
        raise ValueError(f"request count must be >= 0, got {num_total}")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    total = sum(weights)
    exact = [num_total * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: num_total - sum(counts)]:
        counts[i] += 1
    return counts
