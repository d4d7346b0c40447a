"""The offload protocol, one suite over every transport: POSIX shared memory here, CUDA
where a GPU is present (skipped with the reason otherwise).

Each test drives the one OffloadSender and OffloadReceiver; what differs per transport is
only how the pair is built (``Channel``) and that a CUDA wait is settled after it is
enqueued (``settle``; a no-op on CPU, where the wait itself raises).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from offload_helpers import random_batch, reference_executor

from weaver.offload.layout import (
    DONE_SEQ_OFFSET,
    INT64_MAX,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    HotAttentionShape,
    RegionLayout,
    RegionStatus,
)
from weaver.offload.protocol import (
    OffloadTaskFailed,
    OffloadTicket,
    OffloadTimeout,
    Transport,
)
from weaver.offload.receiver import OffloadReceiver
from weaver.offload.reference_attention import (
    paged_decode_attention_reference,
    write_kv_reference,
)
from weaver.offload.sender import OffloadSender
from weaver.offload.shm import ShmRegion

SHAPES = {
    # vLLM CPU_ATTN needs blocks of a multiple of 32; the CUDA kernels of 16.
    "shm": HotAttentionShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=32,
                             block_size=32, dtype="float32"),
    "cuda": HotAttentionShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype="float32"),
}


def layout_for(kind: str) -> RegionLayout:
    return RegionLayout(SHAPES[kind], num_remote_blocks=12, max_seqs_per_task=4,
                        max_blocks_per_seq=3)


@dataclasses.dataclass
class Channel:
    """A sender and a receiver over one region of a transport."""

    sender: OffloadSender
    receiver: OffloadReceiver
    owner: Transport
    device: torch.device
    layout: RegionLayout

    @property
    def shape(self) -> HotAttentionShape:
        return self.layout.shape

    @property
    def scale(self) -> float:
        return self.shape.head_size ** -0.5

    def settle(self, ticket: OffloadTicket) -> None:
        """Raise now what a device wait found (CPU waits raised already)."""
        self.sender.settle(ticket)

    def wait(self, ticket: OffloadTicket, timeout_s: float = 10.0) -> torch.Tensor:
        out = self.sender.wait(ticket, timeout_s=timeout_s)
        self.settle(ticket)
        return out.cpu()

    def fill_pool(self, gen: torch.Generator) -> None:
        """Random K/V for every slot of every layer, in the oracle's layout."""
        num_slots = self.layout.num_remote_blocks * self.shape.block_size
        slots = torch.arange(num_slots)
        for layer in range(self.shape.num_layers):
            pool = torch.zeros(self.layout.kv_layer_shape)
            key = torch.randn(num_slots, self.shape.num_kv_heads, self.shape.head_size,
                              generator=gen)
            value = torch.randn(num_slots, self.shape.num_kv_heads, self.shape.head_size,
                                generator=gen)
            write_kv_reference(pool, key, value, slots)
            self.sender.kv_layer(layer).copy_(pool)

    def submit_random(self, layer: int, num_seqs: int,
                      gen: torch.Generator) -> tuple[OffloadTicket, torch.Tensor]:
        q = torch.randn(num_seqs, self.shape.num_q_heads, self.shape.head_size, generator=gen)
        lens, table = random_batch(self.layout, num_seqs, gen)
        ticket = self.sender.submit(layer, q.to(self.device), lens, table, scale=self.scale)
        expected = paged_decode_attention_reference(
            q, self.sender.kv_layer(layer).cpu(), lens, table, self.scale, key_layout="nd")
        return ticket, expected


@contextlib.contextmanager
def shm_channel(name: str) -> Iterator[Channel]:
    layout = layout_for("shm")
    owner = ShmRegion.create(layout, name)
    receiver = OffloadReceiver(owner, reference_executor)
    sender = OffloadSender(ShmRegion.attach(layout, name))
    try:
        yield Channel(sender, receiver, owner, torch.device("cpu"), layout)
    finally:
        sender.close()
        receiver.close()


@contextlib.contextmanager
def cuda_channel(name: str) -> Iterator[Channel]:
    from weaver.offload.cuda.jit import KernelLibrary, unavailable_reason
    from weaver.offload.cuda.transport import CudaPollingExecutor, CudaRegion

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    layout = layout_for("cuda")
    # One process: the hot side uses the owner's region object (CUDA IPC cannot open a
    # handle in the process that exported it; tests/gpu covers two processes).
    owner = CudaRegion.create(layout, name, "cuda:0", KernelLibrary(0))
    receiver = OffloadReceiver(owner, CudaPollingExecutor(num_blocks=4))
    sender = OffloadSender(owner)
    try:
        yield Channel(sender, receiver, owner, torch.device("cuda:0"), layout)
    finally:
        receiver.close()


CHANNELS: dict[str, Callable[[str], Any]] = {"shm": shm_channel, "cuda": cuda_channel}


@pytest.fixture(params=["shm", pytest.param("cuda", marks=pytest.mark.gpu)])
def channel(request, shm_name) -> Iterator[Channel]:
    name = shm_name if request.param == "shm" else f"test-{uuid.uuid4().hex[:8]}"
    with CHANNELS[request.param](name) as chan:
        yield chan


def test_tasks_served_at_poll_points_match_the_oracle(channel):
    gen = torch.Generator().manual_seed(0)
    channel.fill_pool(gen)
    assert channel.receiver.poll() is False  # nothing pending: a no-op
    for step in range(6):
        layer, num_seqs = step % 2, 1 + step % channel.layout.max_seqs_per_task
        ticket, expected = channel.submit_random(layer, num_seqs, gen)
        channel.receiver.poll()
        got = channel.wait(ticket)
        assert got.shape == (num_seqs, channel.shape.num_q_heads, channel.shape.head_size)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert channel.sender.stats.num_submitted == 6
    assert not channel.receiver.has_pending()


def test_wait_times_out_then_the_region_is_busy_until_the_task_is_served(channel):
    gen = torch.Generator().manual_seed(3)
    channel.fill_pool(gen)
    ticket, _ = channel.submit_random(0, 2, gen)
    start = time.monotonic()
    with pytest.raises(OffloadTimeout, match="not done") as err:
        channel.wait(ticket, timeout_s=0.3)  # nobody polls
    assert 0.3 <= time.monotonic() - start < 3.0
    assert err.value.reason == "timeout"
    assert channel.sender.stats.num_timeouts == 1
    assert not channel.sender.can_submit()
    with pytest.raises(OffloadTimeout, match="still being served") as busy:
        channel.submit_random(0, 2, gen)
    assert busy.value.reason == "busy"
    channel.receiver.poll()  # the cold side shows up late and serves the stale task
    assert channel.sender.can_submit()
    ticket, expected = channel.submit_random(1, 2, gen)
    channel.receiver.poll()
    torch.testing.assert_close(channel.wait(ticket), expected, rtol=1e-4, atol=1e-4)


def test_a_closing_cold_side_ends_a_pending_wait(channel):
    gen = torch.Generator().manual_seed(4)
    ticket, _ = channel.submit_random(0, 1, gen)
    channel.owner.write_word(STATUS_OFFSET, int(RegionStatus.CLOSING))  # as close() begins
    start = time.monotonic()
    with pytest.raises(OffloadTimeout, match="CLOSING") as err:
        channel.wait(ticket, timeout_s=30)
    assert err.value.reason == "closed"
    assert time.monotonic() - start < 5.0  # ended by the status, not the timeout
    with pytest.raises(OffloadTimeout) as again:
        channel.submit_random(0, 1, gen)
    assert again.value.reason == "closed"


def test_a_block_id_outside_the_pool_fails_the_task_not_the_cold_side(channel):
    # A stray write after the hot side's checks must not make the cold side read outside
    # its pool: the task fails, and the next one is served.
    gen = torch.Generator().manual_seed(6)
    channel.fill_pool(gen)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    block_size = channel.shape.block_size
    q = torch.zeros(1, channel.shape.num_q_heads, channel.shape.head_size,
                    device=channel.device)
    ticket = channel.sender.submit(0, q, torch.tensor([2 * block_size + 6]), table,
                                   scale=channel.scale)
    staged = channel.owner.tensor(channel.layout.block_table_offset, (1, 3), torch.int32)
    staged[0, 2] = 1000
    channel.receiver.poll()
    with pytest.raises(OffloadTaskFailed, match=f"failed offload task {ticket.seq}"):
        channel.wait(ticket, timeout_s=5)
    ticket, expected = channel.submit_random(0, 2, gen)
    channel.receiver.poll()
    torch.testing.assert_close(channel.wait(ticket), expected, rtol=1e-4, atol=1e-4)


def test_sequence_number_refuses_to_wrap(channel):
    channel.owner.write_word(TASK_SEQ_OFFSET, INT64_MAX)
    channel.owner.write_word(DONE_SEQ_OFFSET, INT64_MAX)
    sender = OffloadSender(channel.owner)
    q = torch.zeros(1, channel.shape.num_q_heads, channel.shape.head_size,
                    device=channel.device)
    with pytest.raises(OverflowError, match="overflow int64"):
        sender.submit(0, q, torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32),
                      scale=channel.scale)


def _bad_inputs(shape: HotAttentionShape) -> list[tuple[dict, str]]:
    h, d, n = shape.num_q_heads, shape.head_size, 3 * shape.block_size
    return [
        (dict(layer=2), "layer 2 out of range"),
        (dict(q=torch.zeros(2, h, d // 2)), "q must be"),
        (dict(q=torch.zeros(2, h, d, dtype=torch.float16)), "dtype"),
        (dict(q=torch.zeros(5, h, d), seq_lens=torch.ones(5, dtype=torch.int32),
              block_table=torch.zeros(5, 3, dtype=torch.int32)), r"num_seqs in \[1, 4\]"),
        (dict(q=torch.zeros(3, h, d)), rf"q must be \[2, {h}, {d}\]"),
        (dict(seq_lens=torch.tensor([1, n + 1], dtype=torch.int32)), "seq_lens must be in"),
        (dict(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), "seq_lens must be in"),
        (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 12]], dtype=torch.int32)),
         "block ids"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "max_blocks_per_seq"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs(SHAPES["shm"]))))
def test_submit_rejects_bad_input(channel, case):
    change, match = _bad_inputs(channel.shape)[case]
    args = dict(
        layer=0,
        q=torch.zeros(2, channel.shape.num_q_heads, channel.shape.head_size),
        seq_lens=torch.tensor([1, 3 * channel.shape.block_size], dtype=torch.int32),
        block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
    )
    args.update(change)
    args["q"] = args["q"].to(channel.device)
    with pytest.raises(ValueError, match=match):
        channel.sender.submit(**args, scale=channel.scale)
    assert channel.sender.stats.num_submitted == 0


def test_unused_block_ids_beyond_seq_len_are_not_checked(channel):
    # Columns past a sequence's last block are padding in vLLM's block tables.
    table = torch.tensor([[0, 99, -1]], dtype=torch.int32)
    q = torch.zeros(1, channel.shape.num_q_heads, channel.shape.head_size,
                    device=channel.device)
    ticket = channel.sender.submit(0, q, torch.tensor([5]), table, scale=channel.scale)
    channel.receiver.poll()
    channel.wait(ticket, timeout_s=5)
