"""The one definition of SLO attainment and goodput, used by `weaver bench`, the simulator,
the planner and the plots.

- A request **meets the SLO** when it finished and both its TTFT <= T_ttft and its
  TPOT <= T_tpot (a one-token answer has no decode phase: its TPOT cannot miss).
- **Attainment** is the share of *submitted* requests that meet it: a request that failed,
  was cut at a deadline or never sent is a miss, so an overloaded run cannot look good by
  serving only the requests it managed to finish.
- **Goodput** is the highest request rate whose attainment is >= 90 % (DistServe, Zhong et
  al., OSDI 2024, Sec. 2.2). From a sweep it is read conservatively: the highest tested
  rate such that every tested rate at or below it passes, so a sweep that passes again
  above a failing rate (noise) never reports the lucky point.

An SLO is given in seconds, or as a multiple of the model's isolated latency measured at
low load (MuxServe's way, Duan et al., ICML 2024, Sec. 5.1): `Slo.scaled`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weaver.results.records import RequestRecord, RequestStatus

ATTAINMENT_TARGET = 0.90  # DistServe's goodput: the rate at which 90 % meet the SLO


@dataclass(frozen=True)
class Slo:
    """Per-request latency targets, in seconds (infinite: not constrained)."""

    ttft_s: float = math.inf
    tpot_s: float = math.inf

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0 s, got TTFT {self.ttft_s} s and "
                             f"TPOT {self.tpot_s} s")

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> Slo:
        return cls(ttft_s=math.inf if ttft_ms is None else ttft_ms / 1000,
                   tpot_s=math.inf if tpot_ms is None else tpot_ms / 1000)

    @classmethod
    def scaled(cls, isolated_ttft_s: float, isolated_tpot_s: float, ttft_scale: float,
               tpot_scale: float) -> Slo:
        """Targets as multiples of a model's isolated (low-load) latencies."""
        return cls(ttft_s=ttft_scale * isolated_ttft_s, tpot_s=tpot_scale * isolated_tpot_s)

    def met_by(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """A finished request's latencies against the targets; `tpot_s` None: one token."""
        return ttft_s is not None and ttft_s <= self.ttft_s \
            and (tpot_s is None or tpot_s <= self.tpot_s)

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_ms": None if math.isinf(self.ttft_s) else 1000 * self.ttft_s,
                "tpot_ms": None if math.isinf(self.tpot_s) else 1000 * self.tpot_s}

    def describe(self) -> str:
        parts = [f"{name} <= {1000 * value:g} ms" for name, value in
                 (("TTFT", self.ttft_s), ("TPOT", self.tpot_s)) if not math.isinf(value)]
        return " and ".join(parts) or "no latency target"


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Finished, and within both targets."""
    return record.status is RequestStatus.OK and slo.met_by(record.ttft_s, record.tpot_s)


def attainment(records: Sequence[RequestRecord], slo: Slo,
               num_submitted: int | None = None) -> float:
    """The share of submitted requests that met the SLO. `num_submitted` defaults to the
    records given (every submitted request has a record, sent or not)."""
    total = len(records) if num_submitted is None else num_submitted
    if total <= 0:
        raise ValueError("SLO attainment needs at least one submitted request")
    return sum(meets_slo(r, slo) for r in records) / total


def passes(attainment_share: float, target: float = ATTAINMENT_TARGET) -> bool:
    return attainment_share >= target - 1e-12


def goodput_rate(points: Iterable[tuple[float, float]],
                 target: float = ATTAINMENT_TARGET) -> float:
    """Goodput from (rate, attainment) points of a sweep (a rate may repeat: its points are
    averaged): the highest rate such that it and every lower tested rate pass. 0.0 when the
    lowest rate already fails."""
    by_rate: dict[float, list[float]] = {}
    for rate, share in points:
        by_rate.setdefault(float(rate), []).append(float(share))
    if not by_rate:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    best = 0.0
    for rate in sorted(by_rate):
        shares = by_rate[rate]
        if not passes(sum(shares) / len(shares), target):
            break
        best = rate
    return best


def mean_tpot_max_rate(points: Iterable[tuple[float, float | None]], tpot_s: float) -> float:
    """The Weaver paper's "max throughput" (its Fig. 4 reads it off mean TPOT against the
    offered rate): the highest rate such that it and every lower tested rate keep the mean
    TPOT within `tpot_s`; a rate with no finished request fails. TTFT is not looked at, so
    a run whose queue only grows can pass: the simulator reports it beside goodput, never
    instead of it. 0.0 when the lowest rate already fails."""
    as_attainment = ((rate, 1.0 if mean is not None and mean <= tpot_s else 0.0)
                     for rate, mean in points)
    return goodput_rate(as_attainment)
