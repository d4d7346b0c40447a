"""Algorithm 1 (weaver/splitting/algorithm.py): hand-checked runs and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weaver.splitting.algorithm import (
    OperatorSpec,
    SplitConfig,
    SplitPlan,
    SplitStep,
    StopReason,
    chunk_times,
    plan_split,
    plan_wait,
)


def _config(threshold_s=0.0, slack_s=0.0, overhead_s=0.0, **kwargs) -> SplitConfig:
    # K = N + slack; N = 1 unless a test needs otherwise.
    remote = kwargs.pop("remote_attention_s", 1.0)
    return SplitConfig(
        threshold_s=threshold_s,
        local_attention_s=remote + slack_s,
        remote_attention_s=remote,
        overhead_s=overhead_s,
        **kwargs,
    )


def _abc() -> list[OperatorSpec]:
    return [
        OperatorSpec("A", 8.0, split_dim_size=8),
        OperatorSpec("B", 4.0, split_dim_size=8),
        OperatorSpec("C", 1.0, split_dim_size=1),  # cannot be split
    ]


def test_hand_checked_run_stops_below_threshold():
    # W0 = (64 + 16 + 1) / 26. A (8) is split first: [4,4 | 4 | 1] W = 49/26.
    # A and B tie at 4; A comes first in the list: [2,2,2,2 | 4 | 1] W = 33/26.
    # B: [2,2,2,2 | 2,2 | 1] W = 25/26 <= 1.0: stop.
    plan = plan_split(_abc(), _config(threshold_s=1.0))
    assert plan.wait_before_s == pytest.approx(81 / 26)
    assert [(s.name, s.chunks_before, s.chunks_after) for s in plan.steps] == [
        ("A", 1, 2),
        ("A", 2, 4),
        ("B", 1, 2),
    ]
    assert [s.wait_after_s for s in plan.steps] == pytest.approx([49 / 26, 33 / 26, 25 / 26])
    assert plan.chunks == {"A": 4, "B": 2, "C": 1}
    assert plan.wait_after_s == pytest.approx(25 / 26)
    assert plan.stop_reason is StopReason.BELOW_THRESHOLD
    assert plan.max_chunk_before_s == 8.0
    # p99: F(r) * 13 = 5 + r on [4, 8] -> 12.87; after, 1 + 6 r on [1, 2] -> 12.87.
    assert plan.wait_p99_before_s == pytest.approx(7.87)
    assert plan.wait_p99_after_s == pytest.approx(11.87 / 6)
    assert plan.max_chunk_after_s == 2.0


def test_stops_when_no_chunk_exceeds_slack():
    plan = plan_split(_abc(), _config(threshold_s=0.0, slack_s=2.0))
    assert plan.chunks == {"A": 4, "B": 2, "C": 1}
    assert plan.stop_reason is StopReason.WITHIN_SLACK
    assert plan.stall_after_s == 0.0  # nothing is longer than the slack any more
    assert plan.stall_before_s == pytest.approx((6**2 + 2**2) / 26)


def test_already_below_threshold_splits_nothing():
    plan = plan_split(_abc(), _config(threshold_s=10.0))
    assert plan.chunks == {"A": 1, "B": 1, "C": 1}
    assert plan.steps == []
    assert plan.wait_after_s == plan.wait_before_s


def test_dimension_bounds_chunks_and_uneven_chunks():
    op = OperatorSpec("A", 3.0, split_dim_size=3)
    assert chunk_times(op, 2) == pytest.approx([2.0, 1.0])
    plan = plan_split([op], _config(slack_s=-0.5))  # K < N: the hot side always blocks
    assert [s.chunks_after for s in plan.steps] == [2, 3]  # doubling capped at the dimension
    assert plan.chunks == {"A": 3}
    assert plan.stop_reason is StopReason.EXHAUSTED


def test_min_chunk_size_caps_chunks():
    op = OperatorSpec("gate_up", 1e-3, split_dim_size=3072, min_chunk_size=64)
    assert op.max_chunks == 48
    plan = plan_split([op], _config(slack_s=-1.0))
    assert [s.chunks_after for s in plan.steps] == [2, 4, 8, 16, 32, 48]


def test_overhead_can_make_a_split_worse_and_the_planner_rejects_it():
    op = OperatorSpec("A", 1.0, split_dim_size=1024)
    config = _config(overhead_s=2.0)
    # Two chunks of 0.5 + 2 * 1/2 = 1.5 each: W = 0.75 > 0.5.
    assert chunk_times(op, 2, 2.0) == pytest.approx([1.5, 1.5])
    assert plan_wait([op], {"A": 2}, config) > plan_wait([op], {"A": 1}, config)
    plan = plan_split([op], config)
    assert plan.steps == [SplitStep("A", 1, 2, pytest.approx(0.75), False)]
    assert plan.chunks == {"A": 1}
    assert plan.wait_after_s == plan.wait_before_s
    assert plan.stop_reason is StopReason.EXHAUSTED


def test_instances_weight_the_wait_and_the_overhead():
    layer = OperatorSpec("down", 1.0, split_dim_size=64, num_instances=30)
    head = OperatorSpec("lm_head", 10.0, split_dim_size=64)
    config = _config(overhead_s=0.01)
    # (30 * 1 + 100) / (2 * 40)
    assert plan_wait([layer, head], {}, config) == pytest.approx(130 / 80)
    plan = plan_split([layer, head], _config(threshold_s=1.0, overhead_s=0.01))
    assert plan.steps[0].name == "lm_head"  # longest chunk first, not largest share
    expected_overhead = sum(
        op.num_instances * (plan.chunks[op.name] - 1) * 0.01 for op in (layer, head)
    )
    assert plan.total_overhead_s == pytest.approx(expected_overhead)


def test_queueing_term_is_part_of_w_but_not_reducible():
    ops = [OperatorSpec("A", 1.0, split_dim_size=1024)]
    config = _config(threshold_s=0.0, slack_s=-1.0, arrival_rate=0.25, remote_attention_s=2.0)
    plan = plan_split(ops, config)
    floor = 0.25 * 4 / (2 * 0.5)
    assert plan.wait_before_s == pytest.approx(0.5 + floor)
    assert plan.wait_after_s == pytest.approx(floor + 0.5 / 1024)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "non-empty name"),
        ({"time_s": -1.0}, "time_s"),
        ({"time_s": math.inf}, "time_s"),
        ({"split_dim_size": 0}, "split_dim_size"),
        ({"num_instances": 2.0}, "num_instances"),
        ({"min_chunk_size": True}, "min_chunk_size"),
    ],
)
def test_operator_spec_validation(kwargs, message):
    values = {"name": "A", "time_s": 1.0, "split_dim_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        OperatorSpec(**values)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unique"):
        plan_split([OperatorSpec("A", 1.0, 4), OperatorSpec("A", 2.0, 4)], _config())
    with pytest.raises(ValueError, match="no operators"):
        plan_split([], _config())
    with pytest.raises(ValueError, match="1..8 chunks"):
        chunk_times(OperatorSpec("A", 1.0, 8), 9)
    with pytest.raises(ValueError, match="overhead_s"):
        _config(overhead_s=-1.0)
    with pytest.raises(ValueError, match="offload fewer"):
        _config(arrival_rate=2.0)


def test_plan_json_round_trip(tmp_path):
    plan = plan_split(_abc(), _config(threshold_s=1.0, overhead_s=0.01))
    assert SplitPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert SplitPlan.load(path) == plan
    assert plan.chunks_for("A") == 4
    assert plan.chunks_for("not_in_plan") == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema_version": 99}, "schema_version"),
        ({"chunks": {"A": 0}}, "ints >= 1"),
        ({"stop_reason": "bored"}, "stop_reason"),
        ({"steps": [{"name": "A"}]}, "malformed step"),
    ],
)
def test_plan_from_dict_errors(change, message):
    data = plan_split(_abc(), _config(threshold_s=1.0)).to_dict()
    data.update(change)
    with pytest.raises(ValueError, match=message):
        SplitPlan.from_dict(data)


def test_plan_from_dict_missing_key():
    data = plan_split(_abc(), _config(threshold_s=1.0)).to_dict()
    del data["wait_after_s"]
    with pytest.raises(ValueError, match="wait_after_s"):
        SplitPlan.from_dict(data)


# ---- properties -------------------------------------------------------------------------

operator_specs = st.builds(
    OperatorSpec,
    name=st.text("abcdefgh", min_size=1, max_size=6),
    time_s=st.floats(1e-6, 1e-2),
    split_dim_size=st.integers(1, 4096),
    num_instances=st.integers(1, 40),
    min_chunk_size=st.integers(1, 64),
)
op_lists = st.lists(operator_specs, min_size=1, max_size=6, unique_by=lambda op: op.name)
configs = st.builds(
    SplitConfig,
    threshold_s=st.floats(0.0, 1e-3),
    local_attention_s=st.floats(0.0, 5e-3),
    remote_attention_s=st.floats(0.0, 5e-3),
    overhead_s=st.sampled_from([0.0, 1e-7, 1e-6, 1e-5, 1e-4]),
)


@st.composite
def ops_and_chunks(draw):
    ops = draw(op_lists)
    chunks = {op.name: draw(st.integers(1, op.max_chunks)) for op in ops}
    return ops, chunks


@given(ops_and_chunks(), st.data())
def test_split_never_raises_w_without_overhead(ops_chunks, data):
    ops, chunks = ops_chunks
    op = data.draw(st.sampled_from(ops))
    bigger = data.draw(st.integers(chunks[op.name], op.max_chunks))
    config = _config()
    before = plan_wait(ops, chunks, config)
    after = plan_wait(ops, {**chunks, op.name: bigger}, config)
    assert after <= before * (1 + 1e-12)


@given(operator_specs, st.integers(1, 4096), st.sampled_from([0.0, 1e-6, 1e-3]))
def test_chunks_sum_to_time_plus_overhead(op, num_chunks, overhead_s):
    num_chunks = min(num_chunks, op.max_chunks)
    times = chunk_times(op, num_chunks, overhead_s)
    assert len(times) == num_chunks
    assert sum(times) == pytest.approx(op.time_s + (num_chunks - 1) * overhead_s)
    assert times[0] == max(times)


@settings(max_examples=150, deadline=None)
@given(op_lists, configs)
def test_plan_properties(ops, config):
    plan = plan_split(ops, config)  # returning at all is the termination property
    max_steps = sum(math.ceil(math.log2(op.max_chunks)) + 1 for op in ops)
    assert len(plan.steps) <= max_steps
    for op in ops:
        assert 1 <= plan.chunks[op.name] <= op.max_chunks
    assert plan.wait_after_s <= plan.wait_before_s
    assert plan.wait_after_s == pytest.approx(plan_wait(ops, plan.chunks, config))
    accepted = [s.wait_after_s for s in plan.steps if s.is_accepted]
    assert all(b < a for a, b in zip([plan.wait_before_s, *accepted], accepted, strict=False))
    if config.overhead_s == 0.0:
        assert all(s.is_accepted for s in plan.steps)
        # Halving an op raises F(r) = sum min(r, T_i) / S pointwise: every quantile drops.
        assert plan.wait_p99_after_s <= plan.wait_p99_before_s * (1 + 1e-9)
    if plan.stop_reason is StopReason.BELOW_THRESHOLD:
        assert plan.wait_after_s <= config.threshold_s
    else:
        assert plan.wait_after_s > config.threshold_s
    if plan.stop_reason is StopReason.WITHIN_SLACK:
        # Operators still splittable (below their cap, never retired by overhead).
        retired = {s.name for s in plan.steps if not s.is_accepted}
        longest = max(
            chunk_times(op, plan.chunks[op.name], config.overhead_s)[0]
            for op in ops
            if plan.chunks[op.name] < op.max_chunks and op.name not in retired
        )
        assert longest <= config.slack_s
    assert SplitPlan.from_json(plan.to_json()) == plan
