"""The pure parts of benchmarks/unified_pool_reclaim.py (the run itself takes ~10 minutes
of four engines): its arguments and its plot."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("unified_pool_reclaim")


def test_bad_arguments_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--levels", "0"])
    assert bench.parse_args(["--levels", "2", "8"]).levels == [2, 8]


def test_prompts_are_deterministic_and_of_mixed_lengths(bench):
    prompts = bench.make_prompts(32, offset=3)
    assert prompts == bench.make_prompts(32, offset=3)
    assert len({len(p) for p in prompts}) > 10


def test_plot_marks_the_cold_levels(bench, tmp_path):
    result = {"timeline": [{"t": 0.0, "hot_pages": 10, "size": 100},
                           {"t": 1.0, "hot_pages": 90, "size": 100},
                           {"t": 1.5, "level": 4},
                           {"t": 2.0, "hot_pages": 40, "size": 100}]}
    bench.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
