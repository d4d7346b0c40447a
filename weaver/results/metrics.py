"""Serving metrics from per-request records.

- Latency statistics (mean and percentiles) of TTFT, TPOT = (E2E - TTFT) / (n_out - 1),
  ITL (every gap between streamed chunks) and E2E, with request and output-token
  throughput, per model (as vLLM's benchmarks/benchmark_serving.py reports them).
- SLO attainment as MuxServe defines it (Duan et al., ICML 2024, Sec. 5.1): a request meets
  the SLO at scale s if its E2E <= s x its E2E when served alone; scales 5 and 8.
- Splitwise-style slowdown percentiles (Patel et al., ISCA 2024, Sec. 6): p50/p90/p99 of
  E2E / isolated E2E.
- The share of requests meeting a TTFT and TPOT SLO (the one definition, with goodput:
  weaver/results/goodput.py).

The isolated E2E of a request is TTFT_iso(input) + n_out x TPOT_iso, with TTFT linear in the
prompt length; the constants come from a low-load run (`fit_isolated`) or are given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from pydantic import BaseModel

from weaver.results.goodput import Slo, attainment, meets_slo
from weaver.results.records import (
    ALL_MODELS,
    LatencyStats,
    ModelSummary,
    RequestRecord,
    RequestStatus,
    SloSummary,
    percentile_key,
)

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
MUXSERVE_SLO_SCALES = (5.0, 8.0)


class IsolatedEstimate(BaseModel):
    """A model's latency with no contention: TTFT = base + per_token x input; TPOT const."""

    ttft_base_s: float
    ttft_per_input_token_s: float = 0.0
    tpot_s: float

    def e2e_s(self, input_tokens: int, output_tokens: int) -> float:
        ttft = self.ttft_base_s + self.ttft_per_input_token_s * input_tokens
        return ttft + output_tokens * self.tpot_s


def latency_stats(
    values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> LatencyStats | None:
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return None
    return LatencyStats(
        num=int(data.size),
        mean=float(data.mean()),
        percentiles={percentile_key(p): float(np.percentile(data, p)) for p in percentiles},
    )


def summarize_model(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> ModelSummary:
    if not duration_s > 0:
        raise ValueError(f"run duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.status is RequestStatus.OK]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    return ModelSummary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=sum(r.status is RequestStatus.ERROR for r in records),
        num_unfinished=sum(r.status is RequestStatus.UNFINISHED for r in records),
        num_not_sent=sum(r.status is RequestStatus.NOT_SENT for r in records),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_token_throughput=sum(r.num_output_tokens for r in ok) / duration_s,
        ttft=latency_stats((r.ttft_s for r in ok if r.ttft_s is not None), percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats((gap for r in ok for gap in r.itl_s), percentiles),
        e2e=latency_stats((r.e2e_s for r in ok if r.e2e_s is not None), percentiles),
    )


def by_model(records: Iterable[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Records grouped by model name, models in sorted order."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.model, []).append(record)
    return dict(sorted(groups.items()))


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, ModelSummary]:
    """One summary per model, plus `ALL_MODELS` over every record."""
    out = {
        model: summarize_model(mine, duration_s, percentiles)
        for model, mine in by_model(records).items()
    }
    out[ALL_MODELS] = summarize_model(records, duration_s, percentiles)
    return out


def fit_isolated(records: Sequence[RequestRecord]) -> dict[str, IsolatedEstimate]:
    """Per-model isolated latencies from a low-load run: a least-squares line of TTFT over
    the prompt length (server-reported when known) and the median TPOT."""
    out: dict[str, IsolatedEstimate] = {}
    for model, mine in by_model(records).items():
        ok = [r for r in mine if r.status is RequestStatus.OK]
        tpots = [t for r in ok if (t := r.tpot_s) is not None]
        if not ok or not tpots:
            raise ValueError(
                f"model {model!r}: the isolated run has no finished request with >= 2 output "
                "tokens; run it longer or give the isolated constants"
            )
        lengths = np.asarray([r.num_prompt_tokens or r.input_tokens for r in ok], dtype=float)
        ttfts = np.asarray([r.ttft_s for r in ok], dtype=float)
        base, slope = float(np.median(ttfts)), 0.0
        if np.ptp(lengths) > 0:
            fit_slope, fit_base = np.polyfit(lengths, ttfts, 1)
            # A negative slope is noise on a short run; fall back to a constant TTFT.
            if fit_slope >= 0 and fit_base >= 0:
                base, slope = float(fit_base), float(fit_slope)
        out[model] = IsolatedEstimate(
            ttft_base_s=base, ttft_per_input_token_s=slope, tpot_s=float(np.median(tpots))
        )
    return out


def _isolated_for(record: RequestRecord, isolated: Mapping[str, IsolatedEstimate]) -> float:
    if record.model not in isolated:
        raise ValueError(
            f"no isolated latency estimate for model {record.model!r}; have {sorted(isolated)}"
        )
    return isolated[record.model].e2e_s(record.input_tokens, record.output_tokens)


def slo_attainment(
    records: Sequence[RequestRecord],
    isolated: Mapping[str, IsolatedEstimate],
    scales: Sequence[float] = MUXSERVE_SLO_SCALES,
) -> dict[str, float]:
    """Fraction of all requests with E2E <= scale x isolated E2E, per scale. A request that
    failed, was cut at the deadline or never sent counts as a miss: the system did not
    serve it within any SLO."""
    if not records:
        raise ValueError("SLO attainment needs at least one request record")
    out = {}
    for scale in scales:
        met = sum(
            r.status is RequestStatus.OK
            and r.e2e_s is not None
            and r.e2e_s <= scale * _isolated_for(r, isolated)
            for r in records
        )
        out[f"{scale:g}"] = met / len(records)
    return out


def slowdown_percentiles(
    records: Sequence[RequestRecord],
    isolated: Mapping[str, IsolatedEstimate],
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, float]:
    """Percentiles of E2E / isolated E2E over finished requests."""
    ratios = [
        r.e2e_s / _isolated_for(r, isolated)
        for r in records
        if r.status is RequestStatus.OK and r.e2e_s is not None
    ]
    if not ratios:
        return {}
    return {percentile_key(p): float(np.percentile(ratios, p)) for p in percentiles}


def slo_summary(
    records: Sequence[RequestRecord],
    duration_s: float,
    isolated: Mapping[str, IsolatedEstimate] | None = None,
    slo: Slo | None = None,
    scales: Sequence[float] = MUXSERVE_SLO_SCALES,
) -> SloSummary:
    """MuxServe's E2E-scale attainment (with `isolated`) and, with `slo`, the share of the
    submitted requests meeting it (weaver.results.goodput) and their rate in this run."""
    summary = SloSummary(attainment={}, slowdown={})
    if isolated is not None:
        summary.attainment = slo_attainment(records, isolated, scales)
        summary.slowdown = slowdown_percentiles(records, isolated)
    if slo is not None:
        if not duration_s > 0:
            raise ValueError(f"run duration must be > 0 s, got {duration_s}")
        good = [r for r in records if meets_slo(r, slo)]
        summary.slo = slo.to_json()
        summary.slo_attainment = attainment(records, slo)
        summary.good_requests_per_s = len(good) / duration_s
        summary.good_tokens_per_s = sum(r.num_output_tokens for r in good) / duration_s
    return summary
