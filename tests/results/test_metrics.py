"""Metrics and MuxServe SLO attainment on hand-computed records."""

from __future__ import annotations

import pytest

from weaver.results.goodput import Slo
from weaver.results.metrics import (
    IsolatedEstimate,
    fit_isolated,
    latency_stats,
    slo_attainment,
    slo_summary,
    slowdown_percentiles,
    summarize,
)
from weaver.results.records import ALL_MODELS, RequestRecord, RequestStatus

OK, ERROR, UNFINISHED, NOT_SENT = (
    RequestStatus.OK,
    RequestStatus.ERROR,
    RequestStatus.UNFINISHED,
    RequestStatus.NOT_SENT,
)


def rec(model="m", ttft=0.1, e2e=1.0, n_out=10, n_in=100, status=OK, rid=0, itl=None):
    finished = status is OK
    return RequestRecord(
        request_id=rid, model=model, input_tokens=n_in, output_tokens=n_out,
        scheduled_at_s=0.0, sent_at_s=None if status is NOT_SENT else 0.0,
        ttft_s=ttft if status in (OK, UNFINISHED) else None, e2e_s=e2e if finished else None,
        itl_s=itl or [], num_output_tokens=n_out if finished else 0, status=status,
    )


def test_tpot_definition():
    assert rec(ttft=0.1, e2e=1.0, n_out=10).tpot_s == pytest.approx(0.1)  # 0.9 s / 9
    assert rec(n_out=1).tpot_s is None
    assert rec(status=ERROR).tpot_s is None


def test_summarize_per_model_and_throughput():
    records = [
        rec("a", ttft=0.1, e2e=1.0, n_out=10, itl=[0.1] * 9),   # TPOT 0.1
        rec("a", ttft=0.3, e2e=2.1, n_out=10, itl=[0.2] * 9),   # TPOT 0.2
        rec("a", status=ERROR),
        rec("b", ttft=0.2, e2e=0.6, n_out=5, itl=[0.1] * 4),    # TPOT 0.1
        rec("b", status=UNFINISHED),
        rec("b", status=NOT_SENT),
    ]
    summary = summarize(records, duration_s=4.0)
    a, b, total = summary["a"], summary["b"], summary[ALL_MODELS]
    assert (a.num_requests, a.num_ok, a.num_errors) == (3, 2, 1)
    assert (b.num_unfinished, b.num_not_sent) == (1, 1)
    assert a.request_throughput == pytest.approx(0.5)
    assert a.output_token_throughput == pytest.approx(5.0)
    assert total.output_token_throughput == pytest.approx(25 / 4)
    assert a.tpot.mean == pytest.approx(0.15)
    assert a.tpot.p(50) == pytest.approx(0.15)
    assert a.ttft.p(90) == pytest.approx(0.28)  # linear interpolation between 0.1 and 0.3
    assert a.itl.num == 18 and a.itl.mean == pytest.approx(0.15)
    assert total.e2e.num == 3
    assert b.failed_fraction == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="percentile"):
        a.tpot.p(95)


def test_latency_stats_empty_and_percentiles():
    assert latency_stats([]) is None
    stats = latency_stats(range(1, 101), percentiles=(50, 99))
    assert stats.p(50) == pytest.approx(50.5)
    assert stats.p(99) == pytest.approx(99.01)


ISO = {"m": IsolatedEstimate(ttft_base_s=0.05, ttft_per_input_token_s=0.001, tpot_s=0.02)}


def test_isolated_e2e_and_muxserve_attainment():
    # Isolated E2E for 100 in / 10 out: 0.05 + 0.1 + 10 * 0.02 = 0.35 s.
    assert ISO["m"].e2e_s(100, 10) == pytest.approx(0.35)
    records = [
        rec(e2e=0.35 * 4),    # slowdown 4: meets x5 and x8
        rec(e2e=0.35 * 5),    # exactly x5: meets both
        rec(e2e=0.35 * 6),    # meets x8 only
        rec(e2e=0.35 * 9),    # meets neither
        rec(status=ERROR),    # a failure misses every SLO
    ]
    assert slo_attainment(records, ISO) == {"5": pytest.approx(0.4), "8": pytest.approx(0.6)}
    slow = slowdown_percentiles(records, ISO, percentiles=(50, 100))
    assert slow == {"p50": pytest.approx(5.5), "p100": pytest.approx(9.0)}
    with pytest.raises(ValueError, match="no isolated"):
        slo_attainment([rec(model="other")], ISO)


def test_slo_summary_counts_requests_meeting_both_targets_over_all_submitted():
    records = [
        rec(ttft=0.1, e2e=1.0, n_out=10),   # TPOT 0.1: meets 0.15
        rec(ttft=0.1, e2e=1.9, n_out=10),   # TPOT 0.2: misses
        rec(ttft=0.1, e2e=0.1, n_out=1),    # no decode: meets
        rec(ttft=0.6, e2e=1.5, n_out=10),   # TPOT 0.1 but TTFT 0.6: misses a 0.5 s TTFT
        rec(status=ERROR),
    ]
    summary = slo_summary(records, 2.0, ISO, slo=Slo(ttft_s=0.5, tpot_s=0.15))
    assert summary.slo_attainment == pytest.approx(2 / 5)
    assert summary.good_requests_per_s == pytest.approx(1.0)
    assert summary.good_tokens_per_s == pytest.approx(5.5)
    assert summary.slo == {"ttft_ms": 500.0, "tpot_ms": 150.0}
    assert set(summary.attainment) == {"5", "8"}


def test_fit_isolated_recovers_linear_ttft_and_median_tpot():
    records = [
        rec(ttft=0.02 + 0.0005 * n, e2e=0.02 + 0.0005 * n + 9 * 0.03, n_in=n, rid=n)
        for n in (100, 300, 500, 900)
    ]
    est = fit_isolated(records)["m"]
    assert est.ttft_base_s == pytest.approx(0.02, abs=1e-6)
    assert est.ttft_per_input_token_s == pytest.approx(0.0005, rel=1e-4)
    assert est.tpot_s == pytest.approx(0.03)
    with pytest.raises(ValueError, match="isolated run"):
        fit_isolated([rec(status=ERROR)])


