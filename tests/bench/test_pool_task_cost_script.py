"""benchmarks/pool_task_cost.py runs end to end on a tiny shape and writes its verdict first
(its timings are not checked: they belong to the benchmark); bad arguments are refused."""

from __future__ import annotations

import importlib.util
import json

import pytest
from bench_scripts import load_benchmark

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("pool_task_cost")


def test_tiny_run_checks_both_ways_agree_and_writes_the_verdict_first(bench, tmp_path):
    out = tmp_path / "cost.json"
    assert bench.main(["--layers", "2", "--batches", "40", "70,33", "--rounds", "2",
                       "--repeats", "1", "--flush-mib", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert next(iter(report)) == "verdict"
    assert "tasks cost the cold's core" in report["verdict"]
    assert [row["seq_lens"] for row in report["steps"]] == [[40], [70, 33]]
    for row in report["steps"]:
        assert len(row["kept_step_ms"]) == len(row["rebuilt_step_ms"]) == 2
        assert all(ms > 0 for ms in row["kept_step_ms"] + row["rebuilt_step_ms"])


def test_bad_arguments_are_refused(bench, capsys):
    assert bench.main(["--block-size", "48", "--rounds", "1"]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--batches", "10,x"])
    assert "comma-separated lengths" in capsys.readouterr().err
