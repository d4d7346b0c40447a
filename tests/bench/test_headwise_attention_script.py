"""benchmarks/headwise_attention.py runs end to end on a tiny shape (its timings are not
checked: they belong to the benchmark), and refuses a block size vLLM's kernel cannot take."""

from __future__ import annotations

import importlib.util

import pytest
from bench_scripts import load_benchmark

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM (CPU build) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("headwise_attention")


def test_tiny_run_checks_equality_and_prints_the_ratio(bench, capsys):
    assert bench.main(["--layers", "2", "--seqs", "3", "--context", "70", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal outputs" in out
    assert "headwise / vllm_layout = " in out


def test_bad_block_size_is_an_error(bench, capsys):
    assert bench.main(["--block-size", "48", "--rounds", "1"]) == 2
    assert "multiple of 32" in capsys.readouterr().err
