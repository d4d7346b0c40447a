"""The uniform-lengths trace: workloads the shipped traces lack (long outputs)."""

from __future__ import annotations

import pytest

from weaver.workloads.builder import ModelLoad, WorkloadSpec, build_workload
from weaver.workloads.traces import load_trace


def test_uniform_rows_are_within_their_spans_and_always_the_same():
    rows = load_trace("uniform:16-48:64-160")
    assert {r.input_tokens for r in rows} <= set(range(16, 49))
    assert min(r.output_tokens for r in rows) == 64 and max(r.output_tokens for r in rows) == 160
    assert rows == load_trace("uniform:16-48:64-160")


def test_a_uniform_workload_builds_with_no_filter_or_file():
    spec = WorkloadSpec(models=[ModelLoad("hot")], trace="uniform:10-10:100-100", rate=1.0,
                        num_requests=5, seed=3)
    requests = build_workload(spec)
    assert [(r.input_tokens, r.output_tokens) for r in requests] == [(10, 100)] * 5


@pytest.mark.parametrize("name", ["uniform:16-48", "uniform:a-b:1-2", "uniform:5-1:1-2"])
def test_a_malformed_uniform_trace_says_the_form(name):
    with pytest.raises(ValueError, match="uniform:IN_LO-IN_HI:OUT_LO-OUT_HI|LO <= HI"):
        load_trace(name)
