import pytest

from weaver.results.goodput import Slo
from weaver.sim.metrics import summarize, tokens_by


def rec(arrival, ttft, e2e, output=11, model="a"):
    tpot = (e2e - ttft) / (output - 1)
    return {"request_id": 0, "model": model, "arrival_s": arrival, "input_tokens": 10,
            "output_tokens": output, "instance": "gpu0", "is_remote": False,
            "num_preemptions": 0, "is_rejected": False, "ttft_s": ttft, "tpot_s": tpot,
            "e2e_s": e2e}


def test_tokens_are_spread_between_first_token_and_finish():
    r = rec(arrival=1.0, ttft=1.0, e2e=11.0)  # first token at 2, last at 12
    assert tokens_by(r, 1.5) == 0
    assert tokens_by(r, 2.0) == 1
    assert tokens_by(r, 7.0) == pytest.approx(6.0)
    assert tokens_by(r, 20.0) == 11


def test_window_counts_only_what_happens_inside_it():
    records = [rec(0.0, 1.0, 5.0), rec(5.0, 1.0, 10.0), rec(9.0, 20.0, 30.0)]
    unfinished = dict(rec(9.5, 1.0, 2.0), ttft_s=None, tpot_s=None, e2e_s=None)
    summary = summarize(records + [unfinished], Slo(ttft_s=5.0, tpot_s=10.0), {"a": 4},
                        window=(0.0, 10.0))["a"]
    assert summary["num_completed"] == 3 and summary["num_submitted"] == 4
    assert summary["throughput_rps"] == pytest.approx(3 / 10)  # the unfinished one is not
    assert summary["goodput_rps"] <= summary["throughput_rps"]
    assert summary["goodput_rps"] == pytest.approx(2 / 10)  # the third missed its TTFT
    assert summary["slo_attainment"] == pytest.approx(2 / 4)
    expected_tokens = 11 + tokens_by(records[1], 10.0)
    assert summary["output_tokens_per_s"] == pytest.approx(expected_tokens / 10)
    assert summary["ttft_s"]["p50"] == pytest.approx(1.0)
