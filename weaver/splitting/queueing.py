"""The cold device as a polling system: how long an offloaded attention task waits.

Weaver paper §4.2 (operator splitting). The cold device looks for offloaded attention
tasks only at its poll points, i.e. between two of its own kernels, so a task that
arrives while a cold operator runs waits until that operator ends. The cold model has an
infinite backlog: it runs its operators cyclically, one decode step after another, with
operator ``i`` taking ``T_i`` seconds.

Single outstanding task (one hot engine, one task per layer, the hot side waits for it)
---------------------------------------------------------------------------------------
The task's arrival instant is uniform over the cold timeline. Operator ``i`` covers the
fraction ``T_i / S`` of it (``S = sum_j T_j``), and given that the task lands inside
operator ``i`` the time left of it, the *residual* ``R``, is uniform on ``[0, T_i]``.
So ``R`` is a mixture of uniforms and

    W = E[R] = sum_i (T_i / S) * (T_i / 2) = sum_i T_i**2 / (2 S).

A long operator counts quadratically: it is both more likely to be hit and, when hit,
longer to wait for. Its CDF is ``F(r) = sum_i min(r, T_i) / S`` (each operator adds
``(T_i / S) * min(r / T_i, 1)``), piecewise linear in ``r``, so every quantile is exact.

Queued tasks (several hot engines or several tasks in flight)
-------------------------------------------------------------
If tasks arrive as a Poisson stream of rate ``lam = 1 / M`` and each takes ``N`` seconds,
the cold device is an M/G/1 server with *multiple vacations*: once no task is pending it
runs a cold operator (a vacation) and polls again at its end; pending tasks are served
exhaustively at a poll point. The Fuhrmann-Cooper decomposition (Bertsekas & Gallager,
*Data Networks*, §3.5.1) gives the mean wait before service as the plain M/G/1 wait plus
the mean residual vacation:

    W = lam * E[N**2] / (2 (1 - rho)) + E[V**2] / (2 E[V]),   rho = lam * E[N] < 1.

With the cold operators as the vacations, ``E[V**2] / (2 E[V]) = sum T_i**2 / (2 S)``,
the single-task term above (the ``1 / n`` of both moments cancels). The decomposition is
exact for i.i.d. vacations; the cold schedule is cyclic rather than i.i.d., so here it is
the standard approximation that replaces the cycle by its stationary mix of operators.
The queueing term does not depend on ``T_i``: splitting cannot reduce it.

Counts: ``counts[i]`` says how often operator ``i`` occurs per cycle (a per-layer
operator occurs ``num_layers`` times); it is the same as repeating ``T_i`` that often.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _weighted_times(
    op_times: Sequence[float], counts: Sequence[int] | None
) -> list[tuple[float, int]]:
    """Validate the operator times and their counts; return ``(T_i, count_i)`` pairs."""
    times = [float(t) for t in op_times]
    if not times:
        raise ValueError("op_times is empty: pass the duration of every cold operator")
    if counts is None:
        counts = [1] * len(times)
    elif len(counts) != len(times):
        raise ValueError(
            f"counts has {len(counts)} entries but op_times has {len(times)}: "
            "give one count per operator"
        )
    for t in times:
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"operator time {t!r} is not a finite number >= 0 seconds")
    for c in counts:
        if isinstance(c, bool) or int(c) != c or c < 0:
            raise ValueError(f"operator count {c!r} is not an integer >= 0")
    pairs = [(t, int(c)) for t, c in zip(times, counts, strict=True)]
    if sum(t * c for t, c in pairs) <= 0:
        raise ValueError("the cold operators take no time in total: give positive op_times")
    return pairs


def expected_residual(op_times: Sequence[float], counts: Sequence[int] | None = None) -> float:
    """Mean time until the running cold operator ends, seen at a uniform instant.

    ``sum_i c_i T_i**2 / (2 sum_i c_i T_i)`` (module docstring, paper §4.2). This is the
    expected wait ``W`` of a task that never queues behind another task.
    """
    pairs = _weighted_times(op_times, counts)
    total = sum(t * c for t, c in pairs)
    return sum(t * t * c for t, c in pairs) / (2.0 * total)


def queueing_delay(arrival_rate: float, service_time: float) -> float:
    """The M/G/1 part of the wait: ``lam N**2 / (2 (1 - lam N))`` for a fixed service ``N``.

    Raises ValueError when the tasks arrive faster than they can be served (``lam N >= 1``).
    """
    if not math.isfinite(arrival_rate) or arrival_rate < 0:
        raise ValueError(f"arrival_rate {arrival_rate!r} must be a finite rate >= 0 tasks/s")
    if not math.isfinite(service_time) or service_time < 0:
        raise ValueError(f"service_time {service_time!r} must be a finite time >= 0 seconds")
    utilisation = arrival_rate * service_time
    if utilisation >= 1.0:
        raise ValueError(
            f"offloaded tasks keep the cold device busy {utilisation:.0%} of the time "
            "(arrival_rate * service_time >= 1), so their queue grows without bound: "
            "offload fewer sequences or give them a faster cold device"
        )
    return arrival_rate * service_time**2 / (2.0 * (1.0 - utilisation))


def expected_wait(
    op_times: Sequence[float],
    counts: Sequence[int] | None = None,
    *,
    arrival_rate: float = 0.0,
    service_time: float = 0.0,
) -> float:
    """Expected wait ``W`` of an offloaded task before it starts on the cold device.

    With the default ``arrival_rate=0`` tasks never queue and ``W`` is
    :func:`expected_residual`. Otherwise tasks arrive at rate ``1 / M`` and take
    ``service_time = N`` each, and the M/G/1-with-vacations form of the module docstring
    adds :func:`queueing_delay`.
    """
    residual = expected_residual(op_times, counts)
    if arrival_rate == 0.0:
        return residual
    return residual + queueing_delay(arrival_rate, service_time)


def residual_cdf(r: float, op_times: Sequence[float], counts: Sequence[int] | None = None) -> float:
    """``P(R <= r) = sum_i c_i min(r, T_i) / sum_i c_i T_i`` for a single outstanding task."""
    pairs = _weighted_times(op_times, counts)
    if r <= 0:
        return 0.0
    total = sum(t * c for t, c in pairs)
    return min(1.0, sum(min(r, t) * c for t, c in pairs) / total)


def residual_quantile(
    q: float, op_times: Sequence[float], counts: Sequence[int] | None = None
) -> float:
    """Exact ``q``-quantile of the residual ``R`` (e.g. ``q=0.99`` for the p99 wait).

    ``F(r)`` is linear between consecutive sorted operator times, with slope
    ``sum_{T_i > r} c_i / S``; walk the sorted times until ``F`` reaches ``q`` and solve
    the linear piece. Valid for a single outstanding task (no queueing term); there is no
    closed form once tasks queue.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q!r} must lie in [0, 1] (0.99 for p99)")
    pairs = sorted((t, c) for t, c in _weighted_times(op_times, counts) if c > 0 and t > 0)
    total = sum(t * c for t, c in pairs)
    target = q * total  # solve sum_i c_i min(r, T_i) = target for r
    covered = 0.0  # sum of c_i T_i over operators shorter than the current piece
    remaining = sum(c for _, c in pairs)  # sum of c_i over operators at least that long
    for t, c in pairs:
        if covered + remaining * t >= target:  # F(t) * S reaches the target on this piece
            return (target - covered) / remaining
        covered += t * c
        remaining -= c
    return pairs[-1][0]  # q == 1 up to rounding: the longest operator


def expected_stall(
    op_times: Sequence[float], slack_s: float, counts: Sequence[int] | None = None
) -> float:
    """Expected time the hot side is blocked, ``E[max(0, R + N - K)]`` with ``slack = K - N``.

    The hot side runs its local attention (``K``) while the task waits (``R``) and runs
    (``N``), so it blocks for ``R + N - K`` when that is positive (paper §4.2). For one
    operator, ``E[(U T - s)+]`` with ``U`` uniform on [0, 1] is ``(T - s)**2 / (2 T)`` when
    ``0 <= s <= T``; weighting by ``T_i / S`` gives ``sum_i c_i (T_i - s)+**2 / (2 S)``.
    With ``s < 0`` the hot side always blocks and the stall is ``W - s``. Only operators
    longer than the slack cause stalls, which is why Algorithm 1 stops at ``K - N``.
    """
    if not math.isfinite(slack_s):
        raise ValueError(f"slack_s {slack_s!r} must be a finite number of seconds (K - N)")
    pairs = _weighted_times(op_times, counts)
    total = sum(t * c for t, c in pairs)
    if slack_s < 0:
        return sum(t * t * c for t, c in pairs) / (2.0 * total) - slack_s
    return sum(max(0.0, t - slack_s) ** 2 * c for t, c in pairs) / (2.0 * total)
