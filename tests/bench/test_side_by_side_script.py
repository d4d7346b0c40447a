"""benchmarks/side_by_side.py: one model's mean TPOT over another's, both served in the same
run, per run and as the geometric mean over runs (that swap their cores)."""

from __future__ import annotations

import json
import math

import pytest
from bench_scripts import load_benchmark

from weaver.results.metrics import summarize
from weaver.results.records import RequestRecord, RequestStatus, RunResult, new_result, save_result


@pytest.fixture(scope="module")
def script():
    return load_benchmark("side_by_side")


def _run(label: str, tpot_s: dict[str, float], shift_s: float = 0.0) -> RunResult:
    """Each model sent the same five requests at the same times (the last model's shifted
    by `shift_s`)."""
    last = list(tpot_s)[-1]
    records = [RequestRecord(
        request_id=10 * i + k, model=model, input_tokens=4, output_tokens=11,
        scheduled_at_s=i + (shift_s if model == last else 0.0),
        sent_at_s=float(i), ttft_s=0.1, e2e_s=0.1 + 10 * tpot, num_output_tokens=11,
        status=RequestStatus.OK) for i in range(5) for k, (model, tpot) in enumerate(
            tpot_s.items())]
    return RunResult(label=label, base_url="http://x", rate=1.0, started_at="", duration_s=30,
                     workload={}, loadgen={}, records=records, summary=summarize(records, 30.0))


def test_the_ratio_per_run_and_over_the_swapped_runs(script, tmp_path, capsys):
    result = new_result(["weaver", "bench", "compare", "a.yaml", "b.yaml"])
    result.runs = [_run("twins", {"plain": 0.100, "lending": 0.110}),
                   _run("twins_swapped", {"plain": 0.100, "lending": 0.099})]
    path = save_result(result, tmp_path / "twins.json")
    out = tmp_path / "report.json"
    assert script.main([str(path), "--model", "lending", "--over", "plain",
                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert next(iter(report)) == "verdict"
    assert [row["ratio"] for row in report["runs"]] == pytest.approx([1.10, 0.99])
    assert report["ratio"] == pytest.approx(math.sqrt(1.10 * 0.99))
    assert report["verdict"].startswith("lending over plain") and report["same_requests"]
    assert "twins x1.100, twins_swapped x0.990" in report["verdict"]
    assert "lending 110.0 ms, plain 100.0 ms, x1.100" in capsys.readouterr().out


def test_a_run_without_the_model_says_which_models_it_has(script, tmp_path):
    result = new_result(["weaver", "bench", "run"])
    result.runs = [_run("twins", {"plain": 0.1, "other": 0.1})]
    path = save_result(result, tmp_path / "r.json")
    with pytest.raises(SystemExit, match="no finished 'lending' request.*'other', 'plain'"):
        script.main([str(path), "--model", "lending", "--over", "plain",
                     "--out", str(tmp_path / "o.json")])


def test_models_sent_different_requests_are_not_comparable(script, tmp_path):
    """The swap cancels a difference between the cores, not one between the two models'
    request streams: the report says so first."""
    result = new_result(["weaver", "bench", "compare", "a.yaml", "b.yaml"])
    result.runs = [_run("twins", {"plain": 0.100, "lending": 0.110}, shift_s=0.5)]
    path = save_result(result, tmp_path / "twins.json")
    out = tmp_path / "report.json"
    script.main([str(path), "--model", "lending", "--over", "plain", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["verdict"].startswith("not comparable: the two models were sent different "
                                        "requests (arrival times or lengths) in twins")
    assert not report["same_requests"]
