"""A colocated engine's `weaver.mux` block and the kind of turn each step asks for
(weaver/vllm_ext/mux_gate.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from weaver.mux.turns import Kind, Mode
from weaver.vllm_ext.mux_gate import mux_membership, step_kind

BLOCK = {"group": "g", "member": "b", "members": {"a": 3.0, "b": 1.0}, "mode": "temporal"}


def test_a_block_round_trips_and_keeps_the_members_order():
    membership = mux_membership({"weaver": {"mux": BLOCK}})
    assert membership is not None
    assert membership.layout.members == ("a", "b") and membership.layout.weights == (3.0, 1.0)
    assert membership.layout.mode is Mode.TEMPORAL and membership.layout.index("b") == 1
    assert membership.to_dict() == {**BLOCK, "skip_limit": 4}
    assert mux_membership({"weaver": {"role": "hot"}}) is None
    assert mux_membership(None) is None


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({**BLOCK, "member": "z"}, "'z' is not a member of mux group 'g'"),
        ({**BLOCK, "mode": "spatial"}, "mode is 'spatial'"),
        ({**BLOCK, "members": ["a", "b"]}, "must map each member to its weight"),
        ({k: v for k, v in BLOCK.items() if k != "mode"}, "missing ['mode']"),
        ({**BLOCK, "extra": 1}, "unknown field(s) ['extra']"),
        ({**BLOCK, "members": {"a": 3.0, "b": 0}}, "one positive weight per member"),
    ],
)
def test_a_bad_block_says_the_fix(block, expected):
    with pytest.raises(ValueError) as info:
        mux_membership({"weaver": {"mux": block}})
    assert expected in str(info.value)


def scheduled(new: int, tokens: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[object()] * new, num_scheduled_tokens=tokens,
                           total_num_scheduled_tokens=sum(tokens.values()))


def test_a_step_with_prompt_tokens_is_a_prefill():
    assert step_kind(scheduled(1, {"r1": 1})) is Kind.PREFILL  # a one-token prompt
    assert step_kind(scheduled(0, {"r1": 1, "r2": 64})) is Kind.PREFILL  # a later chunk
    assert step_kind(scheduled(0, {"r1": 1, "r2": 1})) is Kind.DECODE
    assert step_kind(scheduled(0, {})) is None


def test_the_fields_read_are_vllms():
    from vllm.v1.core.sched.output import SchedulerOutput

    assert step_kind(SchedulerOutput.make_empty()) is None
