"""benchmarks/kv_occupancy.py: the hot model's batch, KV and TPOT per run, read from the
gauges a run scraped, in a steady window; a run that scraped none is refused."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_benchmark

from weaver.results.records import (
    RequestRecord,
    RequestStatus,
    RunResult,
    new_result,
    save_result,
)


@pytest.fixture(scope="module")
def script():
    return load_benchmark("kv_occupancy")


def _run(label: str, running: float, tpot_s: float, scraped: bool = True) -> RunResult:
    records = [RequestRecord(
        request_id=i, model="hot" if i % 4 else "cold", input_tokens=4, output_tokens=11,
        scheduled_at_s=float(i), sent_at_s=float(i), ttft_s=0.1, e2e_s=0.1 + 10 * tpot_s,
        num_output_tokens=11, status=RequestStatus.OK) for i in range(40)]
    # Ramp-up (t < 20 s) reads 0 and is left out; the steady window reads `running`.
    series = {'weaver_num_running{model="hot"}': [(t, 0.0 if t < 20 else running)
                                                  for t in range(0, 45, 5)],
              'weaver_num_running{model="cold"}': [(25.0, 99.0)],
              'weaver_kv_cache_usage{model="hot"}': [(30.0, 0.5)],
              'weaver_remote_kv_blocks_used{cold="cold",hot="hot"}': [(30.0, 40.0)]}
    return RunResult(label=label, base_url="http://x", rate=1.4, started_at="", duration_s=50,
                     workload={}, loadgen={}, records=records, summary={},
                     scraped=series if scraped else {})


def test_means_in_the_steady_window_and_a_verdict_first(script, tmp_path, capsys):
    result = new_result(["weaver", "bench", "compare"])
    result.runs = [_run("auto", 12.0, 0.17), _run("fixed", 17.5, 0.21)]
    source, out = tmp_path / "r.json", tmp_path / "s.json"
    save_result(result, source)
    assert script.main([str(source), "--local-blocks", "16", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert next(iter(summary)) == "verdict"
    auto, fixed = summary["runs"]
    assert auto["running"] == 12.0 and auto["local_blocks_used"] == 8.0  # not the cold's 99
    assert auto["remote_blocks_used"] == 40.0 and auto["waiting"] is None
    assert auto["tpot_p50_ms"] == pytest.approx(170) and auto["attainment"] == 1.0
    assert fixed["attainment"] == 0.0  # TPOT 210 ms over the 200 ms target
    assert "12.0 running: 170 ms, 17.5 running: 210 ms" in summary["verdict"]
    assert "auto | 1.4 | 12.0" in capsys.readouterr().out


def test_a_run_without_scraped_gauges_is_refused(script, tmp_path):
    result = new_result([])
    result.runs = [_run("auto", 12.0, 0.17, scraped=False)]
    save_result(result, tmp_path / "r.json")
    with pytest.raises(SystemExit, match="--scrape-metric"):
        script.main([str(tmp_path / "r.json"), "--local-blocks", "16"])
