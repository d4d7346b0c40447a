"""How a split attention operator cuts a batch into groups of whole sequences
(weaver.splitting.algorithm.group_bounds). That the groups give the very rows of the whole
batch, with vLLM's kernel, is tested in tests/vllm_ext/test_woven_attention.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weaver.splitting.algorithm import group_bounds


def test_group_bounds_by_work():
    assert group_bounds([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    # A heavy first request gets a group of its own; the rest still make two groups.
    assert group_bounds([10, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    # A heavy last request: the cut follows the work, so fewer groups than asked.
    assert group_bounds([1, 1, 1, 30], 3) == [(0, 3), (3, 4)]
    assert group_bounds([5, 5], 4) == [(0, 1), (1, 2)]  # one group per sequence at most
    assert group_bounds([], 3) == []
    with pytest.raises(ValueError, match="num_chunks"):
        group_bounds([1], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=64), st.integers(1, 16))
def test_group_bounds_cover_the_batch_in_order(work, num_chunks):
    bounds = group_bounds(work, num_chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(work)
    assert all(lo < hi for lo, hi in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert len(bounds) <= num_chunks
    if len(set(work)) == 1:  # equal work: exactly min(n, requests) groups
        assert len(bounds) == min(num_chunks, len(work))


def test_a_split_needs_two_chunks():
    pytest.importorskip("vllm")
    from weaver.vllm_ext.layers import AttentionChunks

    with pytest.raises(ValueError, match=">= 2 chunks"):
        AttentionChunks(1)
