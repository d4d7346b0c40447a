"""Poll points as wrapped forwards (weaver/weaving/poll_points.py): a poll right after
each operator, the output untouched, no module hooks, and a clean undo."""

from __future__ import annotations

import pytest
import torch

from weaver.weaving.poll_points import PollPoints


class Recorder:
    """The poll, and what had run when it was called."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.ran = 0

    def poll(self) -> None:
        self.calls.append(self.ran)


def counting_linear(recorder: Recorder) -> torch.nn.Linear:
    layer = torch.nn.Linear(4, 4)
    original = layer.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        recorder.ran += 1
        return original(x)

    layer.forward = forward  # an instance-level forward of someone else, kept underneath
    return layer


def test_polls_after_each_operator_and_keeps_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    polls = []
    points = PollPoints([model[0], model[2]], lambda: polls.append(1))
    assert len(points) == 2
    assert torch.equal(model(x), expected)
    assert len(polls) == 2
    # The fast path stays: no module gained a hook.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    points.remove()
    model(x)
    assert len(polls) == 2
    assert "forward" not in model[0].__dict__


def test_poll_runs_after_forward_and_shadowed_forward_is_restored():
    recorder = Recorder()
    layer = counting_linear(recorder)
    theirs = layer.__dict__["forward"]
    points = PollPoints([layer, layer], recorder.poll)  # listed twice: still one poll
    layer(torch.randn(1, 4))
    layer(torch.randn(1, 4))
    assert recorder.calls == [1, 2]  # each poll saw its forward already done
    points.remove()
    assert layer.__dict__["forward"] is theirs
    points.remove()  # a second remove does nothing


def test_refuses_to_undo_a_forward_replaced_later():
    layer = torch.nn.Linear(4, 4)
    points = PollPoints([layer], lambda: None)
    layer.forward = lambda x: x
    with pytest.raises(RuntimeError, match="replaced after the poll point"):
        points.remove()
