"""Plain-text tables of runs for the terminal (`weaver bench summary` and `compare`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from weaver.results.goodput import Slo, attainment, goodput_rate
from weaver.results.metrics import by_model
from weaver.results.records import ALL_MODELS, LatencyStats, RunResult


def _ms(stats: LatencyStats | None, percentile: float | None = None) -> float:
    if stats is None:
        return math.nan
    return 1000.0 * (stats.mean if percentile is None else stats.p(percentile))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def scraped_table(runs: Sequence[RunResult]) -> str | None:
    """One line per (run, scraped gauge): its mean and max while the run's requests
    arrived (from the first arrival to the last: the load, not the drain after it); None
    when no run scraped any."""
    from weaver.bench.scrape import window_mean

    header = ["deployment", "rate", "gauge", "mean", "max", "samples"]
    rows = []
    for run in runs:
        if not run.scraped or not run.records:
            continue
        rate = "trace" if run.rate is None else f"{run.rate:g}"
        last_arrival = run.last_arrival_s
        for key, points in run.scraped.items():
            inside = [value for t, value in points if 0.0 <= t <= last_arrival]
            mean = window_mean(points, 0.0, last_arrival)
            rows.append([run.label, rate, key, _num(mean), _num(max(inside, default=None)),
                         str(len(inside))])
    return _table(header, rows) + "\n(while the requests arrived)" if rows else None


def summary_table(runs: Sequence[RunResult]) -> str:
    """One line per (run, model): counts, throughput, p50/p90/p99 latencies in ms."""
    header = ["deployment", "rate", "model", "ok/total", "req/s", "tok/s",
              "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "TPOT p99", "ITL p90", "E2E p90"]
    rows = []
    for run in runs:
        rate = "trace" if run.rate is None else f"{run.rate:g}"
        for model, s in run.summary.items():
            name = "(all)" if model == ALL_MODELS else model
            rows.append([
                run.label, rate, name, f"{s.num_ok}/{s.num_requests}",
                f"{s.request_throughput:.2f}", f"{s.output_token_throughput:.1f}",
                f"{_ms(s.ttft, 50):.1f}", f"{_ms(s.ttft, 90):.1f}",
                f"{_ms(s.tpot, 50):.1f}", f"{_ms(s.tpot, 90):.1f}", f"{_ms(s.tpot, 99):.1f}",
                f"{_ms(s.itl, 90):.1f}", f"{_ms(s.e2e, 90):.1f}",
            ])
    return _table(header, rows) + "\n(latencies in ms)"


def slo_table(runs: Sequence[RunResult]) -> str:
    header = ["deployment", "rate", "model", "SLO x5", "SLO x8", "slowdown p50", "p90", "p99",
              "in SLO", "good req/s", "good tok/s"]
    rows = []
    for run in runs:
        rate = "trace" if run.rate is None else f"{run.rate:g}"
        for model, s in run.slo.items():
            rows.append([
                run.label, rate, "(all)" if model == ALL_MODELS else model,
                _pct(s.attainment.get("5")), _pct(s.attainment.get("8")),
                _num(s.slowdown.get("p50")), _num(s.slowdown.get("p90")),
                _num(s.slowdown.get("p99")),
                _pct(s.slo_attainment),
                _num(s.good_requests_per_s), _num(s.good_tokens_per_s),
            ])
    return _table(header, rows) if rows else ""


def comparison_table(runs: Sequence[RunResult], baseline: int = 0) -> str:
    """Each run's throughput and p90 latencies as ratios to run `baseline` (same model)."""
    if not 0 <= baseline < len(runs):
        raise ValueError(f"baseline index {baseline} is out of range for {len(runs)} runs")
    base = runs[baseline]
    header = ["deployment", "model", "tok/s", "x tok/s", "TPOT p90", "x TPOT p90",
              "TTFT p90", "x TTFT p90"]
    rows = []
    for run in runs:
        for model, s in run.summary.items():
            b = base.summary.get(model)
            b_tok = b.output_token_throughput if b else math.nan
            b_tpot = _ms(b.tpot, 90) if b else math.nan
            b_ttft = _ms(b.ttft, 90) if b else math.nan
            rows.append([
                run.label, "(all)" if model == ALL_MODELS else model,
                f"{s.output_token_throughput:.1f}", _ratio(s.output_token_throughput, b_tok),
                f"{_ms(s.tpot, 90):.1f}", _ratio(_ms(s.tpot, 90), b_tpot),
                f"{_ms(s.ttft, 90):.1f}", _ratio(_ms(s.ttft, 90), b_ttft),
            ])
    return _table(header, rows) + f"\n(ratios relative to {base.label}; latencies in ms)"


def _ratio(value: float, reference: float) -> str:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "-"
    return f"{value / reference:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def goodput_lines(runs: Sequence[RunResult], slo: Slo) -> list[str]:
    """Each deployment's goodput per model over the swept rates of `runs`, recomputed from
    their records against `slo` (weaver/results/goodput.py)."""
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in runs:
        if run.rate is None:
            continue
        for model, records in {ALL_MODELS: run.records, **by_model(run.records)}.items():
            points.setdefault((run.label, model), []).append(
                (run.rate, attainment(records, slo)))
    lines = [f"goodput (highest rate with >= 90 % of requests within {slo.describe()}):"]
    for (label, model), sweep in sorted(points.items()):
        rate = goodput_rate(sweep)
        shown = "below every swept rate" if rate == 0 else f"{rate:g} req/s"
        lines.append(f"  {label} {'(all)' if model == ALL_MODELS else model}: {shown}")
    return lines
