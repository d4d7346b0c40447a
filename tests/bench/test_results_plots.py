"""Results JSON round trip and plots drawn from a saved file."""

from __future__ import annotations

import json

import pytest

from weaver.bench.plots import ordered_models, plot_results
from weaver.results.metrics import summarize
from weaver.results.records import (
    RequestRecord,
    RequestStatus,
    RunResult,
    load_result,
    new_result,
    save_result,
)


def _records(model: str, tpot: float, count: int = 4) -> list[RequestRecord]:
    return [
        RequestRecord(
            request_id=i, model=model, input_tokens=50, output_tokens=11, scheduled_at_s=0.1 * i,
            sent_at_s=0.1 * i, ttft_s=0.05, e2e_s=0.05 + 10 * tpot, itl_s=[tpot] * 10,
            num_output_tokens=11, status=RequestStatus.OK,
        )
        for i in range(count)
    ]


def _run(label: str, rate: float, hot_tpot: float, cold_tpot: float) -> RunResult:
    records = _records("llama", hot_tpot, 6) + _records("qwen", cold_tpot, 2)
    return RunResult(
        label=label, base_url="http://127.0.0.1:1", rate=rate, started_at="t", duration_s=2.0,
        workload={"model_rates": {"llama": rate * 0.75, "qwen": rate * 0.25}}, loadgen={},
        records=records, summary=summarize(records, 2.0),
    )


@pytest.fixture
def saved(tmp_path):
    result = new_result(["weaver", "bench", "run"])
    for rate in (1.0, 2.0, 4.0):
        result.runs.append(_run("vllm", rate, 0.02 * rate, 0.03))
        result.runs.append(_run("weaver", rate, 0.015 * rate, 0.035))
    return save_result(result, tmp_path / "sub" / "results.json")


def test_round_trip(saved):
    result = load_result(saved)
    assert result.command == ["weaver", "bench", "run"]
    assert len(result.runs) == 6
    assert result.runs[0].records[0].status is RequestStatus.OK
    assert result.runs[0].summary["llama"].tpot.p(90) == pytest.approx(0.02)
    assert {"hostname", "platform", "python", "num_cpus"} <= set(result.machine)
    raw = json.loads(saved.read_text())
    assert raw["schema_version"] == 1


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_result(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": 3}')
    with pytest.raises(ValueError, match="not a Weaver bench results file"):
        load_result(bad)


def test_hot_model_first(saved):
    runs = load_result(saved).runs
    assert ordered_models(runs) == ["llama", "qwen"]  # more requests: taken as hot
    for run in runs:
        run.roles = {"qwen": "hot", "llama": "cold"}
    assert ordered_models(runs) == ["qwen", "llama"]


def test_plots_written_from_saved_json(saved, tmp_path):
    paths = plot_results([saved], tmp_path / "plots", tpot_slo_s=0.05)
    assert [p.name for p in paths] == ["tpot_vs_rate.png", "throughput.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    with pytest.raises(ValueError, match="at least one"):
        plot_results([], tmp_path)
