"""The one definition of SLO attainment and goodput (weaver/results/goodput.py), and the
simulator and `weaver bench` judging the same records by it."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from weaver.results.goodput import Slo, attainment, goodput_rate, mean_tpot_max_rate, meets_slo
from weaver.results.metrics import slo_summary
from weaver.results.records import RequestRecord, RequestStatus
from weaver.sim.config import load_config, packaged_configs
from weaver.sim.metrics import bench_duration_s, bench_record, summarize
from weaver.sim.runner import simulate


def rec(ttft=0.1, e2e=1.0, n_out=10, status=RequestStatus.OK):
    finished = status is RequestStatus.OK
    return RequestRecord(request_id=0, model="m", input_tokens=10, output_tokens=n_out,
                         scheduled_at_s=0.0, sent_at_s=0.0 if finished else None,
                         ttft_s=ttft if finished else None, e2e_s=e2e if finished else None,
                         num_output_tokens=n_out if finished else 0, status=status)


def test_a_request_meets_the_slo_only_within_both_targets():
    slo = Slo(ttft_s=0.5, tpot_s=0.1)
    assert meets_slo(rec(ttft=0.5, e2e=0.5 + 9 * 0.1), slo)  # both exactly at the target
    assert not meets_slo(rec(ttft=0.6, e2e=0.6 + 9 * 0.05), slo)  # TTFT misses
    assert not meets_slo(rec(ttft=0.1, e2e=0.1 + 9 * 0.2), slo)  # TPOT misses
    assert meets_slo(rec(ttft=0.1, e2e=0.1, n_out=1), slo)  # one token: no decode phase
    assert not meets_slo(rec(status=RequestStatus.UNFINISHED), Slo())
    assert not meets_slo(rec(status=RequestStatus.ERROR), Slo())


def test_attainment_is_over_submitted_requests():
    records = [rec(), rec(), rec(status=RequestStatus.NOT_SENT), rec(status=RequestStatus.ERROR)]
    assert attainment(records, Slo(ttft_s=1.0)) == pytest.approx(0.5)
    assert attainment(records[:2], Slo(ttft_s=1.0), num_submitted=8) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least one"):
        attainment([], Slo())


def test_slo_targets_in_ms_scaled_and_refused():
    assert Slo.from_ms(None, 200) == Slo(ttft_s=math.inf, tpot_s=0.2)
    assert Slo.scaled(0.1, 0.02, ttft_scale=10, tpot_scale=5) == Slo(ttft_s=1.0, tpot_s=0.1)
    assert Slo.from_ms(2000, None).describe() == "TTFT <= 2000 ms"
    with pytest.raises(ValueError, match="> 0"):
        Slo(ttft_s=0.0)


def test_goodput_is_the_highest_rate_at_and_below_which_every_rate_passes():
    assert goodput_rate([(1, 1.0), (2, 0.95), (3, 0.9), (4, 0.5)]) == 3
    # A lucky pass above a failing rate is noise, not capacity.
    assert goodput_rate([(4.0, 0.5), (4.25, 0.6), (4.5, 0.92), (3.0, 0.99)]) == 3.0
    # Repeated rates (seeds) are averaged: (0.95 + 0.8) / 2 < 0.9.
    assert goodput_rate([(1, 1.0), (2, 0.95), (2, 0.8)]) == 1
    assert goodput_rate([(1, 0.2)]) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        goodput_rate([])


def test_the_simulator_and_the_bench_judge_the_same_records_alike():
    """A simulated run's attainment per model is exactly what `weaver bench` reports for
    the same requests recorded as it records them; targets at the run's medians make about
    half of them miss, many right at the boundary."""
    config = load_config(packaged_configs()["tiny"])
    records = simulate(config)["requests"]
    done = [r for r in records if r["e2e_s"] is not None]
    slo = Slo(ttft_s=float(np.median([r["ttft_s"] for r in done])),
              tpot_s=float(np.median([r["tpot_s"] for r in done])))
    submitted = Counter(r["model"] for r in records)
    summary = summarize(records, slo, dict(submitted))
    shares = {name: s["slo_attainment"] for name, s in summary.items() if name != "_all"}
    assert min(shares.values()) > 0.1 and max(shares.values()) < 0.9
    for model, share in shares.items():
        mine = [bench_record(r) for r in records if r["model"] == model]
        bench = slo_summary(mine, bench_duration_s(mine), slo=slo)
        assert bench.slo_attainment == share  # exactly: one function decides


def test_the_papers_max_rate_reads_mean_tpot_alone_and_is_monotone():
    # Mean TPOT (s) per rate; 4 req/s passes again after 3 failed (noise): not counted.
    points = [(1.0, 0.05), (2.0, 0.09), (3.0, 0.12), (4.0, 0.08)]
    assert mean_tpot_max_rate(points, tpot_s=0.1) == 2.0
    assert mean_tpot_max_rate(points, tpot_s=0.2) == 4.0
    assert mean_tpot_max_rate([(1.0, None), (2.0, 0.01)], tpot_s=0.1) == 0.0  # none finished
