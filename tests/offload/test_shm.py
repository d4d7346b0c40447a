"""The CPU transport: the region in POSIX shared memory (creation, attachment, cleanup,
doorbells) and what only a host transport does (the idle poller thread, poll points and
that thread serving together, a cold process that dies, host executors). The protocol
itself is tested over every transport in test_protocol.py."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from offload_helpers import random_batch, reference_executor, start_cold_worker, stop_cold_worker

from weaver.offload.layout import (
    OWNER_PID_OFFSET,
    REGION_MAGIC,
    HotAttentionShape,
    RegionLayout,
)
from weaver.offload.protocol import OffloadTaskFailed, OffloadTimeout
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.reference_attention import (
    paged_decode_attention_reference,
    write_kv_reference,
)
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import (
    DEFAULT_SHM_DIR,
    ShmRegion,
    region_paths,
)
from weaver.processes import is_process_alive
from weaver.weaving.cold import ColdWeaving

SHAPE = HotAttentionShape(
    num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32"
)
LAYOUT = RegionLayout(SHAPE, num_remote_blocks=8, max_seqs_per_task=4, max_blocks_per_seq=4)
CHANNEL_LAYOUT = RegionLayout(SHAPE, num_remote_blocks=12, max_seqs_per_task=4,
                              max_blocks_per_seq=3)
SCALE = SHAPE.head_size**-0.5



def test_create_attach_share_bytes_and_owner_cleans_up(shm_name):
    owner = ShmRegion.create(LAYOUT, shm_name)
    assert all(os.path.exists(p) for p in region_paths(shm_name))
    assert os.path.getsize(owner.path) == LAYOUT.total_bytes
    hot = ShmRegion.attach(LAYOUT, shm_name)
    hot.buffer[LAYOUT.kv_offset] = 42
    assert owner.buffer[LAYOUT.kv_offset] == 42
    assert bytes(hot.buffer[: len(REGION_MAGIC)]) == REGION_MAGIC
    hot.close()
    hot.close()  # safe twice
    assert all(os.path.exists(p) for p in region_paths(shm_name)), "attacher must not unlink"
    owner.close()
    owner.close()
    assert not any(os.path.exists(p) for p in region_paths(shm_name))
    with pytest.raises(ValueError, match="is closed"):
        _ = owner.buffer


def test_attach_with_other_shape_names_the_mismatch(shm_name):
    with ShmRegion.create(LAYOUT, shm_name):
        other = RegionLayout(
            HotAttentionShape(2, 8, 2, 32, 32, "float32"),
            num_remote_blocks=8,
            max_seqs_per_task=4,
            max_blocks_per_seq=4,
        )
        with pytest.raises(ValueError, match="num_q_heads: region has 4, this side expects 8"):
            ShmRegion.attach(other, shm_name)
        same_size = RegionLayout(
            HotAttentionShape(2, 4, 2, 32, 32, "float32"),
            num_remote_blocks=8,
            max_seqs_per_task=4,
            max_blocks_per_seq=5,  # block table grows inside the metadata padding
        )
        if same_size.total_bytes == LAYOUT.total_bytes:
            with pytest.raises(ValueError, match="max_blocks_per_seq"):
                ShmRegion.attach(same_size, shm_name)


def test_attach_missing_region_is_a_clear_error(shm_name):
    start = time.monotonic()
    with pytest.raises(ValueError, match="start the cold side first"):
        ShmRegion.attach(LAYOUT, shm_name, wait_s=0.1)
    assert time.monotonic() - start < 5


def test_attach_waits_for_a_late_owner(shm_name):
    owners: list[ShmRegion] = []
    timer = threading.Timer(0.2, lambda: owners.append(ShmRegion.create(LAYOUT, shm_name)))
    timer.start()
    try:
        hot = ShmRegion.attach(LAYOUT, shm_name, wait_s=10)
        hot.close()
    finally:
        timer.join()
        for region in owners:
            region.close()


def test_live_owner_is_refused_and_dead_owner_is_reclaimed(shm_name):
    first = ShmRegion.create(LAYOUT, shm_name)
    with pytest.raises(ValueError, match="owned by live process"):
        ShmRegion.create(LAYOUT, shm_name)
    # Pretend the owner died without cleaning up: point the header at a reaped pid.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    struct.pack_into("<q", first.buffer, OWNER_PID_OFFSET, child.pid)
    second = ShmRegion.create(LAYOUT, shm_name)
    assert os.path.exists(second.path)
    first._is_owner = False  # its names now belong to `second`
    first.close()
    second.close()


def test_bad_names_and_dirs_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="invalid shared-memory region name"):
        ShmRegion.create(LAYOUT, "../etc/passwd")
    with pytest.raises(ValueError, match="does not exist"):
        ShmRegion.create(LAYOUT, "ok-name", shm_dir=str(tmp_path / "missing"))


def test_fifo_wakeup_sleeps_until_notified(shm_name):
    with ShmRegion.create(LAYOUT, shm_name) as owner:
        hot = ShmRegion.attach(LAYOUT, shm_name)
        assert not owner.wait_for_task(0.01)
        for _ in range(3):
            hot.wake_waiters()  # several notifications coalesce into one wakeup
        assert owner.wait_for_task(1.0)
        assert not owner.wait_for_task(0.01)
        timer = threading.Timer(0.05, hot.wake_waiters)
        timer.start()
        start = time.monotonic()
        assert owner.wait_for_task(5.0)
        assert time.monotonic() - start < 4.0
        timer.join()
        hot.close()


def test_a_cold_engine_closes_before_its_regions_at_exit(shm_name):
    # Each region closes itself at exit too; the cold side must close first (atexit runs
    # the last registered first), or its receivers find their regions closed (a
    # ValueError in the worker's close, registered at its start) and its idle poller rings
    # closed doorbells (EBADF).
    here = os.path.dirname(__file__)
    code = (
        "import atexit, sys\n"
        f"sys.path.insert(0, {here!r})\n"
        "from test_shm import CHANNEL_LAYOUT, reference_executor\n"
        "from weaver.offload.receiver import OffloadReceiver\n"
        "from weaver.offload.shm import ShmRegion\n"
        "from weaver.weaving.cold import ColdWeaving\n"
        "held = []\n"
        "atexit.register(lambda: held[0].close())  # the worker's close, registered first\n"
        f"region = ShmRegion.create(CHANNEL_LAYOUT, {shm_name!r})\n"
        f"held.append(ColdWeaving({{{shm_name!r}: OffloadReceiver(region, reference_executor)}}))\n"
        "held[0].start_idle_poller()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not any(os.path.exists(p) for p in region_paths(shm_name))


def test_a_closed_regions_doorbell_is_not_rung(shm_name):
    owner = ShmRegion.create(CHANNEL_LAYOUT, shm_name)
    owner.close()
    owner.wake_waiters()  # nothing to ring, no waiter: no EBADF


def test_is_process_alive():
    assert is_process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not is_process_alive(child.pid)
    assert not is_process_alive(0)


def test_dev_shm_default():
    assert DEFAULT_SHM_DIR == "/dev/shm" and os.path.isdir(DEFAULT_SHM_DIR)


def test_attacher_process_exit_leaves_region_in_place(shm_name):
    # The resource_tracker trap: an attaching process must never unlink at exit.
    with ShmRegion.create(LAYOUT, shm_name) as owner:
        code = (
            "import sys\n"
            "from weaver.offload.layout import HotAttentionShape, RegionLayout\n"
            "from weaver.offload.shm import ShmRegion\n"
            "shape = HotAttentionShape(2, 4, 2, 32, 32, 'float32')\n"
            "layout = RegionLayout(shape, 8, 4, 4)\n"
            f"region = ShmRegion.attach(layout, {shm_name!r})\n"
            "assert 'torch' not in sys.modules\n"  # attaching alone stays light
            "region.buffer[0:0]\n"  # exit without close()
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert all(os.path.exists(p) for p in region_paths(shm_name))
        assert bytes(owner.buffer[: len(REGION_MAGIC)]) == REGION_MAGIC


@contextlib.contextmanager
def channel_pair(name, executor=reference_executor, *, poller=True, receiver=True):
    owner = ShmRegion.create(CHANNEL_LAYOUT, name)
    recv = OffloadReceiver(owner, executor) if receiver else None
    # The cold engine's idle poller (weaver/weaving/cold.py), over this one region.
    cold = ColdWeaving({name: recv}) if recv is not None else None
    if cold is not None and poller:
        cold.start_idle_poller()
    sender = OffloadSender(ShmRegion.attach(CHANNEL_LAYOUT, name))
    try:
        yield sender, recv, owner
    finally:
        sender.close()
        if cold is not None:
            cold.close()
        else:
            owner.close()


def fill_pool(sender: OffloadSender, gen: torch.Generator) -> None:
    """Random K/V for every slot of every layer, in the oracle's layout."""
    num_slots = CHANNEL_LAYOUT.num_remote_blocks * SHAPE.block_size
    slots = torch.arange(num_slots)
    for layer in range(SHAPE.num_layers):
        key = torch.randn(num_slots, SHAPE.num_kv_heads, SHAPE.head_size, generator=gen)
        value = torch.randn(num_slots, SHAPE.num_kv_heads, SHAPE.head_size, generator=gen)
        write_kv_reference(sender.kv_layer(layer), key, value, slots)


def submit_random(sender, layer, num_seqs, gen):
    q = torch.randn(num_seqs, SHAPE.num_q_heads, SHAPE.head_size, generator=gen)
    lens, table = random_batch(CHANNEL_LAYOUT, num_seqs, gen)
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
            layer, num_seqs = step % 2, 1 + step % CHANNEL_LAYOUT.max_seqs_per_task
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


def test_receiver_close_makes_pending_wait_fail_fast(shm_name):
    gen = torch.Generator().manual_seed(4)
    owner = ShmRegion.create(CHANNEL_LAYOUT, shm_name)
    recv = OffloadReceiver(owner, reference_executor)  # alive, but never serves
    sender = OffloadSender(ShmRegion.attach(CHANNEL_LAYOUT, shm_name))
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
    proc = start_cold_worker(shm_name, CHANNEL_LAYOUT, executor="reference", poller=True)
    try:
        sender = OffloadSender(ShmRegion.attach(CHANNEL_LAYOUT, shm_name, wait_s=30))
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
    ShmRegion.create(CHANNEL_LAYOUT, shm_name).close()


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
        struct.pack_into("<i", owner.buffer, CHANNEL_LAYOUT.block_table_offset + 8, 1000)
        assert recv.poll()
        with pytest.raises(OffloadTaskFailed):
            sender.wait(ticket, timeout_s=1)
        assert calls == [] and recv.stats.num_failed == 1


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
    import weaver.offload.protocol as protocol
    import weaver.offload.sender as sender_module
    import weaver.offload.shm as shm

    checks = []

    def counting_check(*args):
        checks.append(1)
        return protocol.check_task_bounds(*args)

    # the hot side checks in the sender, the cold side in the CPU transport
    monkeypatch.setattr(sender_module, "check_task_bounds", counting_check)
    monkeypatch.setattr(shm, "check_task_bounds", counting_check)
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

        lens, table = random_batch(CHANNEL_LAYOUT, 3, gen)
        first = sender.prepare_batch(lens, table)
        expected_lens, expected_table = lens.clone(), table.clone()
        lens[1], table[1] = 1, 0  # the caller's tensors change: the batch does not
        round_trip(0, expected_lens, expected_table, first)
        # a stray write into the staged block table: the next layer's task does not restage
        struct.pack_into("<i", owner.buffer, CHANNEL_LAYOUT.block_table_offset, 1000)
        q = torch.zeros(3, SHAPE.num_q_heads, SHAPE.head_size)
        ticket = sender.submit_batch(1, q, first, scale=SCALE)
        assert recv.poll()
        with pytest.raises(OffloadTaskFailed):  # the cold side's own check caught it
            sender.wait(ticket, timeout_s=1)
        assert "task 2 rejected: block ids must be in [0, 12)" in caplog.text
        other_lens, other_table = random_batch(CHANNEL_LAYOUT, 2, gen)
        other = sender.prepare_batch(other_lens, other_table)
        round_trip(1, other_lens, other_table, other)
        round_trip(0, expected_lens, expected_table, first)  # staged again, intact
        round_trip(1, expected_lens, expected_table, first)
        # Each side checks each batch once: the hot side when it is prepared (2), the cold
        # side when the staging area holds other bytes than the last batch it passed
        # (first, the corrupted first, other, first again: 4).
        assert len(checks) == 2 + 4
        with pytest.raises(ValueError, match="seq_lens must be in"):
            sender.prepare_batch(torch.tensor([CHANNEL_LAYOUT.max_tokens_per_seq + 1]), table[:1])
