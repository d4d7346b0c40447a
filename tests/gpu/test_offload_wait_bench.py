"""The parts of benchmarks/offload_wait.py that need no GPU: the exit without CUDA, the
summary and acceptance arithmetic, the plot drawn from saved JSON, the GEMM split."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offload_wait.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("offload_wait_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _entry(busy_p99: float, idle_p99: float, quiet_ms: float, busy_ms: float) -> dict:
    return {
        "busy_wait_us": {"n": 10, "p50": busy_p99 / 2, "p99": busy_p99},
        "idle_wait_us": {"n": 10, "p50": idle_p99 / 2, "p99": idle_p99},
        "no_traffic_step_ms": [quiet_ms] * 5,
        "busy_step_ms": [busy_ms] * 5,
        "num_failed": {"busy": 0, "idle": 1},
    }


def test_exits_with_code_2_and_a_reason_without_cuda(bench, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main(["--quick"]) == 2
    assert "cannot run: no CUDA device" in capsys.readouterr().err


def test_bad_arguments_are_refused(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--split-chunks", "1"])


def test_quick_mode_caps_the_work(bench) -> None:
    quick = bench.run_config(bench.parse_args(["--quick"]))
    full = bench.run_config(bench.parse_args([]))
    assert (
        quick.tasks_busy < full.tasks_busy
        and quick.num_no_traffic_steps < full.num_no_traffic_steps
    )


def test_summary_acceptance_and_plot_from_saved_json(bench, tmp_path: Path, capsys) -> None:
    results = {
        "a_cpu_launched": _entry(500.0, 40.0, 10.0, 10.8),
        "b_poll_kernel": _entry(40.0, 12.0, 10.1, 10.3),
        "c_poll_split": _entry(20.0, 12.0, 10.3, 10.4),
        "d_spin_kernel": _entry(30.0, 8.0, 10.5, 10.6),
    }
    report = bench.summarize(results, [10.0] * 7)
    acceptance = report["acceptance"]
    assert acceptance["busy_p99_a_over_b"]["value"] == pytest.approx(12.5)
    assert acceptance["busy_p99_a_over_b"]["passed"]
    assert acceptance["idle_round_trip_p99_us_b"]["passed"]
    assert acceptance["no_traffic_poll_overhead_b"]["value"] == pytest.approx(0.01)
    assert results["d_spin_kernel"]["busy_step_overhead"] == pytest.approx(0.06)
    report.update(gpu="Test GPU", command="python offload_wait.py --quick", receivers=results)
    path = tmp_path / "offload_wait-test.json"
    path.write_text(json.dumps(report))
    assert bench.main(["--plot-only", str(path)]) == 0
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    bench.print_table(json.loads(path.read_text()))
    table = capsys.readouterr().out
    assert "a: CPU-launched" in table and "FAIL" not in table


def test_failed_acceptance_is_reported(bench) -> None:
    results = {
        "a_cpu_launched": _entry(100.0, 40.0, 10.0, 10.0),
        "b_poll_kernel": _entry(40.0, 30.0, 10.5, 10.5),
        "c_poll_split": _entry(20.0, 12.0, 10.0, 10.0),
        "d_spin_kernel": _entry(30.0, 8.0, 10.0, 10.0),
    }
    acceptance = bench.summarize(results, [10.0])["acceptance"]
    assert not any(check["passed"] for check in acceptance.values())


def test_percentiles_ignore_missing_stamps(bench) -> None:
    stats = bench.percentiles_us([0, 1000, 2000, 3000, -5])
    assert stats["n"] == 3 and stats["p50"] == pytest.approx(2.0)
    assert bench.percentiles_us([0]) == {"n": 0}


def test_split_linear_equals_the_whole_product(bench) -> None:
    model = object.__new__(bench.ColdModel)
    model.split_chunks = 3
    x, w = torch.randn(5, 16), torch.randn(16, 70)
    polls: list[int] = []
    split = model._linear(x, w, lambda: polls.append(1), True)
    whole = model._linear(x, w, lambda: None, False)
    assert torch.allclose(split, whole, atol=1e-5) and len(polls) == 3


def test_poll_point_count_matches_the_step(bench) -> None:
    """num_poll_points (reported in the JSON) counts the polls step() really makes."""
    shape = bench.ColdShape(num_layers=2, hidden=8, intermediate=12, num_q_heads=2,
                            num_kv_heads=1, head_size=4, vocab=10)  # fmt: skip
    model = object.__new__(bench.ColdModel)
    model.shape, model.split_chunks = shape, 3
    model._kernels = type("K", (), {"paged_decode_attention": staticmethod(lambda *a, **k: None)})
    model._library = None
    model.w_qkv = torch.randn(8, (2 + 2) * 4)
    model.w_o, model.w_gate_up = torch.randn(8, 8), torch.randn(8, 24)
    model.w_down, model.lm_head = torch.randn(12, 8), torch.randn(8, 10)
    model.kv_pool = model.seq_lens = model.block_table = None
    model.x0, model.attn_out = torch.randn(3, 8), torch.randn(3, 2, 4)
    model.logits = torch.empty(3, 10)
    for is_split in (False, True):
        polls: list[int] = []
        model.step(lambda polls=polls: polls.append(1), is_split)
        assert len(polls) == model.num_poll_points(is_split)
