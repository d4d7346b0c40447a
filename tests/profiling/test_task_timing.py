"""Timing offloaded attention tasks through a real region (weaver.profiling.task_timing)."""

from __future__ import annotations

import os

import pytest

from weaver.offload.layout import HotAttentionShape
from weaver.offload.protocol import OffloadTask
from weaver.offload.reference_attention import paged_decode_attention_reference
from weaver.profiling.task_timing import time_offloaded_attention

SHAPE = HotAttentionShape(num_layers=3, num_q_heads=4, num_kv_heads=2, head_size=16,
                          block_size=8, dtype="float32")


class RecordingReference:
    """The pure-torch oracle as executor, recording what each served task held."""

    def __init__(self) -> None:
        self.tasks: list[tuple[int, list[int], float]] = []

    def __call__(self, task: OffloadTask) -> None:
        # The pool the task reads must be its own layer's: its first value tells them apart
        # only if the layers' pools differ, which the timing fills with distinct randoms.
        self.tasks.append((task.layer, task.seq_lens.tolist(),
                           float(task.kv_layer.flatten()[0])))
        task.out.copy_(paged_decode_attention_reference(
            task.q, task.kv_layer, task.seq_lens, task.block_table, task.scale))


def test_every_layer_is_served_through_the_channel_and_timed(tmp_path):
    executor = RecordingReference()
    timings = time_offloaded_attention(SHAPE, [[10, 20], [40]], executor, num_repeats=2,
                                       flush_bytes=1 << 20, shm_dir=str(tmp_path))
    assert [t.seq_lens for t in timings] == [(10, 20), (40,)]
    for t in timings:
        assert len(t.per_task_s) == SHAPE.num_layers
        assert all(s > 0 for s in t.per_task_s)
        assert t.all_layers_s == pytest.approx(sum(t.per_task_s))
    # (1 warm-up + 2 timed) sweeps over the 3 layers, per batch, in layer order
    assert [layer for layer, _, _ in executor.tasks] == [0, 1, 2] * 3 * 2
    assert {tuple(lens) for _, lens, _ in executor.tasks} == {(10, 20), (40,)}
    first_values = {layer: v for layer, _, v in executor.tasks[:3]}
    assert len(set(first_values.values())) == SHAPE.num_layers  # one pool per layer
    assert os.listdir(tmp_path) == []  # the regions and their doorbells are removed


def test_a_failing_executor_is_an_error_not_a_timing(tmp_path):
    def broken(task: OffloadTask) -> None:
        raise RuntimeError("kernel exploded")

    with pytest.raises(RuntimeError, match="failed offload task"):
        time_offloaded_attention(SHAPE, [[16]], broken, num_repeats=1, flush_bytes=0,
                                 shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, batches, match", [
    ({"num_repeats": 0}, [[8]], "num_repeats"),
    ({"flush_bytes": -1}, [[8]], "flush_bytes"),
    ({}, [[]], ">= 1 token"),
    ({}, [[8, 0]], ">= 1 token"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, batches, match):
    with pytest.raises(ValueError, match=match):
        time_offloaded_attention(SHAPE, batches, lambda task: None, shm_dir=str(tmp_path),
                                 **kwargs)

