from __future__ import annotations

import contextlib
import struct
import threading
import time

import pytest
import torch
from offload_helpers import random_batch, reference_executor, start_cold_worker, stop_cold_worker

from weaver.offload.channel import (
    OffloadReceiver,
    OffloadSender,
    OffloadTaskFailed,
    OffloadTimeout,
)
from weaver.offload.layout import (
    DONE_SEQ_OFFSET,
    INT64_MAX,
    TASK_SEQ_OFFSET,
    HotAttentionShape,
    RegionLayout,
)
from weaver.offload.reference_attention import (
    paged_decode_attention_reference,
    write_kv_reference,
)
from weaver.offload.shm_transport import ShmRegion

SHAPE = HotAttentionShape(
    num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32"
)
LAYOUT = RegionLayout(SHAPE, num_remote_blocks=12, max_seqs_per_task=4, max_blocks_per_seq=3)
SCALE = SHAPE.head_size**-0.5


@contextlib.contextmanager
def channel_pair(name, executor=reference_executor, *, poller=True, receiver=True):
    owner = ShmRegion.create(LAYOUT, name)
    recv = OffloadReceiver(owner, executor, idle_wait_s=0.02) if receiver else None
    if recv is not None and poller:
        recv.start_idle_poller()
    sender = OffloadSender(ShmRegion.attach(LAYOUT, name))
    try:
        yield sender, recv, owner
    finally:
        sender.close()
        if recv is not None:
            recv.close()
        else:
            owner.close()


def fill_pool(sender: OffloadSender, gen: torch.Generator) -> None:
    """Random K/V for every slot of every layer, in the oracle's layout."""
    num_slots = LAYOUT.num_remote_blocks * SHAPE.block_size
    slots = torch.arange(num_slots)
    for layer in range(SHAPE.num_layers):
        key = torch.randn(num_slots, SHAPE.num_kv_heads, SHAPE.head_size, generator=gen)
        value = torch.randn(num_slots, SHAPE.num_kv_heads, SHAPE.head_size, generator=gen)
        write_kv_reference(sender.kv_layer(layer), key, value, slots)


def submit_random(sender, layer, num_seqs, gen):
    q = torch.randn(num_seqs, SHAPE.num_q_heads, SHAPE.head_size, generator=gen)
    lens, table = random_batch(LAYOUT, num_seqs, gen)
    ticket = sender.submit(layer, q, lens, table, scale=SCALE)
    expected = paged_decode_attention_reference(
        q, sender.kv_layer(layer), lens, table, SCALE, key_layout="nd"
    )
    return ticket, expected


def test_round_trip_through_idle_poller(shm_name):
    gen = torch.Generator().manual_seed(0)
    with channel_pair(shm_name) as (sender, recv, _):
        fill_pool(sender, gen)
        for step in range(6):
            layer, num_seqs = step % 2, 1 + step % LAYOUT.max_seqs_per_task
            ticket, expected = submit_random(sender, layer, num_seqs, gen)
            result = sender.wait_with_timing(ticket, timeout_s=10)
            torch.testing.assert_close(result.output, expected)
            assert result.output.shape == (num_seqs, 4, 32)
            assert result.round_trip_s >= result.wait_s >= 0
        assert recv.stats.num_served == 6 and recv.stats.num_served_by_idle_poller == 6
        assert recv.stats.busy_by_idle_poller_s > 0 and recv.stats.busy_at_poll_points_s == 0
        assert sender.stats.num_completed == 6 and sender.stats.num_submitted == 6


def test_poll_point_serves_without_idle_thread(shm_name):
    gen = torch.Generator().manual_seed(1)
    with channel_pair(shm_name, poller=False) as (sender, recv, _):
        fill_pool(sender, gen)
        assert recv.poll() is False  # nothing pending: cheap no-op
        ticket, expected = submit_random(sender, 1, 3, gen)
        assert recv.has_pending()
        assert recv.poll() is True
        assert recv.poll() is False
        torch.testing.assert_close(sender.wait(ticket, timeout_s=1), expected)
        assert recv.stats.num_served_at_poll_points == 1
        assert recv.stats.busy_at_poll_points_s > 0 and recv.stats.busy_by_idle_poller_s == 0
        # An idle loop of the caller's own (the worker extension's) counts as idle serving.
        ticket, expected = submit_random(sender, 0, 2, gen)
        assert recv.poll(by_idle_poller=True) is True
        torch.testing.assert_close(sender.wait(ticket, timeout_s=1), expected)
        assert recv.stats.num_served_by_idle_poller == 1 and recv.stats.busy_by_idle_poller_s > 0


def test_poll_points_and_idle_thread_serve_each_task_once(shm_name):
    calls = []

    def counting_executor(task):
        calls.append(task.seq)
        reference_executor(task)

    gen = torch.Generator().manual_seed(2)
    stop = threading.Event()
    with channel_pair(shm_name, counting_executor) as (sender, recv, _):
        fill_pool(sender, gen)

        def model_thread():
            # A cold engine polls between operators whose kernels release the GIL;
            # sleep(0) stands in for that, or this thread would hog the GIL.
            while not stop.is_set():
                recv.poll()
                time.sleep(0)

        poller = threading.Thread(target=model_thread)
        poller.start()
        try:
            for step in range(30):
                ticket, expected = submit_random(sender, step % 2, 2, gen)
                torch.testing.assert_close(sender.wait(ticket, timeout_s=10), expected)
        finally:
            stop.set()
            poller.join()
        assert calls == list(range(1, 31))
        stats = recv.stats
        assert stats.num_served == 30
        assert stats.num_served_at_poll_points + stats.num_served_by_idle_poller == 30
        assert stats.busy_at_poll_points_s + stats.busy_by_idle_poller_s == pytest.approx(
            stats.total_busy_s)


def test_wait_times_out_without_receiver_then_recovers(shm_name):
    gen = torch.Generator().manual_seed(3)
    with channel_pair(shm_name, receiver=False) as (sender, _, owner):
        ticket, _ = submit_random(sender, 0, 2, gen)
        start = time.monotonic()
        with pytest.raises(OffloadTimeout, match="not done after") as err:
            sender.wait(ticket, timeout_s=0.3)
        elapsed = time.monotonic() - start
        assert err.value.reason == "timeout"
        assert 0.3 <= elapsed < 3.0
        assert sender.stats.num_timeouts == 1
        assert not sender.can_submit()
        with pytest.raises(OffloadTimeout, match="still being served") as busy:
            submit_random(sender, 0, 2, gen)
        assert busy.value.reason == "busy"
        # A receiver that shows up late serves the stale task; the channel is usable again.
        recv = OffloadReceiver(owner, reference_executor)
        assert recv.poll()
        assert sender.can_submit()
        fill_pool(sender, gen)
        ticket, expected = submit_random(sender, 1, 2, gen)
        assert recv.poll()
        torch.testing.assert_close(sender.wait(ticket, timeout_s=1), expected)
        recv.close()


def test_receiver_close_makes_pending_wait_fail_fast(shm_name):
    gen = torch.Generator().manual_seed(4)
    owner = ShmRegion.create(LAYOUT, shm_name)
    recv = OffloadReceiver(owner, reference_executor)  # alive, but never serves
    sender = OffloadSender(ShmRegion.attach(LAYOUT, shm_name))
    ticket, _ = submit_random(sender, 0, 1, gen)
    timer = threading.Timer(0.1, recv.close)
    timer.start()
    start = time.monotonic()
    with pytest.raises(OffloadTimeout, match="CLOS") as err:
        sender.wait(ticket, timeout_s=30)
    assert err.value.reason == "closed"
    assert time.monotonic() - start < 5.0
    timer.join()
    with pytest.raises(OffloadTimeout) as again:
        submit_random(sender, 0, 1, gen)
    assert again.value.reason == "closed"
    assert not sender.can_submit()
    sender.close()


def test_cross_process_round_trip_then_dead_cold_process_fails_fast(shm_name):
    gen = torch.Generator().manual_seed(5)
    proc = start_cold_worker(shm_name, LAYOUT, executor="reference", poller=True)
    try:
        sender = OffloadSender(ShmRegion.attach(LAYOUT, shm_name, wait_s=30))
        fill_pool(sender, gen)
        for step in range(4):  # served by the other process's idle poller
            ticket, expected = submit_random(sender, step % 2, 1 + step, gen)
            torch.testing.assert_close(sender.wait(ticket, timeout_s=30), expected)
        proc.kill()  # SIGKILL: no chance to mark the region closed
        ticket, _ = submit_random(sender, 0, 2, gen)
        start = time.monotonic()
        with pytest.raises(OffloadTimeout, match="died") as err:
            sender.wait(ticket, timeout_s=30)
        assert err.value.reason == "dead"
        assert time.monotonic() - start < 5.0
        sender.close()
    finally:
        stop_cold_worker(proc)
    # The killed owner could not unlink; the next owner reclaims the stale region.
    ShmRegion.create(LAYOUT, shm_name).close()


def test_executor_failure_is_reported_and_channel_survives(shm_name):
    def flaky_executor(task):
        if task.seq == 1:
            raise RuntimeError("boom")
        reference_executor(task)

    gen = torch.Generator().manual_seed(6)
    with channel_pair(shm_name, flaky_executor) as (sender, recv, _):
        fill_pool(sender, gen)
        ticket, _ = submit_random(sender, 0, 2, gen)
        with pytest.raises(OffloadTaskFailed, match="failed offload task 1"):
            sender.wait(ticket, timeout_s=10)
        ticket, expected = submit_random(sender, 0, 2, gen)
        torch.testing.assert_close(sender.wait(ticket, timeout_s=10), expected)
        assert recv.stats.num_failed == 1 and sender.stats.num_failed == 1


def test_cold_side_rejects_out_of_pool_metadata(shm_name):
    # A buggy hot process bypassing submit()'s checks must not make the cold kernel
    # read outside the pool: the task fails, the cold side survives.
    calls = []
    with channel_pair(shm_name, lambda task: calls.append(task.seq), poller=False) as (
        sender,
        recv,
        owner,
    ):
        table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
        ticket = sender.submit(0, torch.zeros(1, 4, 32), torch.tensor([70]), table, scale=SCALE)
        # corrupt the staged block id of block 2 after validation, as a stray write would
        struct.pack_into("<i", owner.buffer, LAYOUT.block_table_offset + 8, 1000)
        assert recv.poll()
        with pytest.raises(OffloadTaskFailed):
            sender.wait(ticket, timeout_s=1)
        assert calls == [] and recv.stats.num_failed == 1


def test_sequence_number_refuses_to_wrap(shm_name):
    gen = torch.Generator().manual_seed(7)
    with channel_pair(shm_name, receiver=False) as (sender, _, owner):
        struct.pack_into("<q", owner.buffer, TASK_SEQ_OFFSET, INT64_MAX)
        struct.pack_into("<q", owner.buffer, DONE_SEQ_OFFSET, INT64_MAX)
        with pytest.raises(OverflowError, match="overflow int64"):
            submit_random(sender, 0, 1, gen)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layer=2), "layer 2 out of range"),
        (dict(q=torch.zeros(2, 4, 16)), "q must be"),
        (dict(q=torch.zeros(2, 4, 32, dtype=torch.float16)), "dtype"),
        (dict(q=torch.zeros(5, 4, 32), seq_lens=torch.ones(5, dtype=torch.int32),
              block_table=torch.zeros(5, 3, dtype=torch.int32)), r"num_seqs in \[1, 4\]"),
        (dict(q=torch.zeros(3, 4, 32)), r"q must be \[2, 4, 32\]"),
        (dict(seq_lens=torch.tensor([1, 97], dtype=torch.int32)), "seq_lens must be in"),
        (dict(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), "seq_lens must be in"),
        (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 12]], dtype=torch.int32)), "block ids"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "max_blocks_per_seq"),
    ],
)
def test_submit_rejects_bad_input(shm_name, change, match):
    args = dict(
        layer=0,
        q=torch.zeros(2, 4, 32),
        seq_lens=torch.tensor([1, 96], dtype=torch.int32),
        block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
    )
    args.update(change)
    with channel_pair(shm_name, receiver=False) as (sender, _, _):
        with pytest.raises(ValueError, match=match):
            sender.submit(**args, scale=SCALE)
        assert sender.stats.num_submitted == 0


def test_unused_block_ids_beyond_seq_len_are_not_checked(shm_name):
    # Columns past a sequence's last block are padding in vLLM's block tables.
    with channel_pair(shm_name, poller=False) as (sender, recv, _):
        table = torch.tensor([[0, 99, -1]], dtype=torch.int32)
        ticket = sender.submit(0, torch.zeros(1, 4, 32), torch.tensor([5]), table, scale=SCALE)
        assert recv.poll()
        sender.wait(ticket, timeout_s=1)


def test_receiver_close_releases_the_executors_views_before_unmapping(shm_name):
    """An executor that keeps views of the region between tasks (CpuPagedAttentionExecutor
    keeps its K/V views) is told to drop them while the region is still mapped."""
    seen = []

    class KeepsViews:
        def __init__(self) -> None:
            self.views = []

        def __call__(self, task) -> None:
            self.views.append(task.kv_layer)
            reference_executor(task)

        def release(self) -> None:
            seen.append((len(self.views), owner.is_closed))
            self.views.clear()

    executor = KeepsViews()
    gen = torch.Generator().manual_seed(6)
    with channel_pair(shm_name, executor) as (sender, _, owner):
        fill_pool(sender, gen)
        ticket, expected = submit_random(sender, 1, 2, gen)
        torch.testing.assert_close(sender.wait(ticket, timeout_s=30), expected)
    assert seen == [(1, False)]  # called once, with the view, before the region closed


def test_layers_of_one_step_share_the_staged_batch(shm_name, monkeypatch, caplog):
    """Every layer of a hot step sends one prepared batch: it is checked once, staged by the
    first layer's task and not copied again; another batch in between is staged in turn.
    The batch keeps its own copy, so changing the caller's tensors afterwards changes
    nothing. Each answer is still the oracle's."""
    import weaver.offload.channel as channel

    checks = []
    real_check = channel.check_task_bounds
    monkeypatch.setattr(channel, "check_task_bounds",
                        lambda *args: checks.append(1) or real_check(*args))
    gen = torch.Generator().manual_seed(11)
    with channel_pair(shm_name, poller=False) as (sender, recv, owner):
        fill_pool(sender, gen)

        def round_trip(layer, lens, table, batch):
            q = torch.randn(len(lens), SHAPE.num_q_heads, SHAPE.head_size, generator=gen)
            ticket = sender.submit_batch(layer, q, batch, scale=SCALE)
            assert recv.poll()
            torch.testing.assert_close(sender.wait(ticket, timeout_s=1),
                                       paged_decode_attention_reference(
                                           q, sender.kv_layer(layer), lens, table, SCALE,
                                           key_layout="nd"))

        lens, table = random_batch(LAYOUT, 3, gen)
        first = sender.prepare_batch(lens, table)
        expected_lens, expected_table = lens.clone(), table.clone()
        lens[1], table[1] = 1, 0  # the caller's tensors change: the batch does not
        round_trip(0, expected_lens, expected_table, first)
        # a stray write into the staged block table: the next layer's task does not restage
        struct.pack_into("<i", owner.buffer, LAYOUT.block_table_offset, 1000)
        q = torch.zeros(3, SHAPE.num_q_heads, SHAPE.head_size)
        ticket = sender.submit_batch(1, q, first, scale=SCALE)
        assert recv.poll()
        with pytest.raises(OffloadTaskFailed):  # the cold side's own check caught it
            sender.wait(ticket, timeout_s=1)
        assert "task 2 rejected: block ids must be in [0, 12)" in caplog.text
        other_lens, other_table = random_batch(LAYOUT, 2, gen)
        other = sender.prepare_batch(other_lens, other_table)
        round_trip(1, other_lens, other_table, other)
        round_trip(0, expected_lens, expected_table, first)  # staged again, intact
        round_trip(1, expected_lens, expected_table, first)
        # Each side checks each batch once: the hot side when it is prepared (2), the cold
        # side when the staging area holds other bytes than the last batch it passed
        # (first, the corrupted first, other, first again: 4).
        assert len(checks) == 2 + 4
        with pytest.raises(ValueError, match="seq_lens must be in"):
            sender.prepare_batch(torch.tensor([LAYOUT.max_tokens_per_seq + 1]), table[:1])
