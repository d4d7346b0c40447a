"""The hot runtime over a device wait (weaving/hot.py): a wait that is a kernel on the hot
stream says nothing to the host, so its fallback is enqueued behind it every layer and the
failures are counted once per step (settle_step), then the pair is degraded.

The CUDA transport cannot run here: `_DeviceWaitSender` stands in for an OffloadSender
over it (its waits return PENDING, as CudaRegion's do; the device's fallback count is
set by the test). The kernels themselves are tested on a GPU
(tests/gpu/test_roundtrip_gpu.py)."""

from __future__ import annotations

import time

import torch

from weaver.offload.protocol import OffloadResult, OffloadTicket, TaskBatch, WaitStatus
from weaver.weaving.hot import HotWeaving, RemoteRows, RowGroup
from weaver.weaving.hot_pairs import HotPairs, StepRows

NUM_HEADS, HEAD_SIZE = 4, 8


class _DeviceWaitSender:
    """Stand-in for OffloadSender over the CUDA transport (see the module docstring)."""

    def __init__(self) -> None:
        self.fallbacks_enqueued: list[int] = []
        self.device_fallbacks = 0  # what the device's counter would hold
        self.out = torch.full((2, NUM_HEADS, HEAD_SIZE), 7.0)  # the output staging
        self._seq = 0

    def prepare_batch(self, seq_lens: torch.Tensor, block_table: torch.Tensor) -> TaskBatch:
        return TaskBatch(seq_lens.to(torch.int32), block_table.to(torch.int32))

    def submit_batch(self, layer: int, q: torch.Tensor, batch: TaskBatch, **_: float
                     ) -> OffloadTicket:
        self._seq += 1
        return OffloadTicket(self._seq, layer, batch.num_seqs, time.monotonic())

    def wait_with_timing(self, ticket: OffloadTicket, timeout_s: float) -> OffloadResult:
        return OffloadResult(self.out[: ticket.num_seqs], ticket, WaitStatus.PENDING, 1e-6,
                             1e-6, 0)

    def enqueue_fallback(self, ticket: OffloadTicket) -> torch.Tensor:
        self.fallbacks_enqueued.append(ticket.seq)
        return self.out[: ticket.num_seqs]  # the device's choice: here, the cold side's

    def take_num_device_fallbacks(self) -> int:
        count, self.device_fallbacks = self.device_fallbacks, 0
        return count


class _HostAttention:
    """The remote pool as the hot side reads it itself when degraded: writes 1.0."""

    def __init__(self) -> None:
        self.num_calls = 0

    def attend(self, ops, rows: RowGroup, query: torch.Tensor, output: torch.Tensor) -> None:
        self.num_calls += 1
        output[rows.tokens] = 1.0


class _Plan:
    hot, cold, timeout_s, num_remote_blocks = "h", "c", 1.0, 2


def _decode_step() -> StepRows:
    rows = RowGroup(tokens=torch.tensor([0, 1]), query_start_loc=torch.tensor([0, 1, 2]),
                    seq_lens=torch.tensor([5, 9]), block_table=torch.tensor([[0], [1]]))
    return StepRows(local=None, remotes=[RemoteRows(0, prefill=None, decode=rows)])


def _attend(runtime: HotWeaving, layer: int, step: StepRows) -> torch.Tensor:
    query = torch.zeros(2, NUM_HEADS, HEAD_SIZE)
    output = torch.zeros_like(query)
    return HotPairs.of(runtime).attend(None, layer, step, query, output, scale=1.0,
                                       sliding_window=-1, softcap=0.0)


def test_each_device_wait_gets_its_fallback_and_failures_degrade_the_pair_once_per_step():
    sender, host = _DeviceWaitSender(), _HostAttention()
    runtime = HotWeaving(_Plan(), sender, remote_kv=host)  # type: ignore[arg-type]
    step = _decode_step()
    for layer in range(3):  # one step, three layers: no host read of any wait
        out = _attend(runtime, layer, step)
        assert torch.equal(out, torch.full_like(out, 7.0))  # the staging, in stream order
    assert sender.fallbacks_enqueued == [1, 2, 3]
    runtime.settle_step()
    assert runtime.degraded_reason is None and runtime.stats.num_offloaded_tasks == 3
    assert runtime.stats.wait_seconds == []  # a device wait's host time is not a wait

    sender.device_fallbacks = 2  # two of the next step's waits timed out on the device
    for layer in range(3):
        _attend(runtime, layer, step)
    runtime.settle_step()
    assert runtime.stats.num_fallback_tasks == 2 and runtime.stats.num_offloaded_tasks == 4
    assert "2 device wait(s) did not end OK" in runtime.degraded_reason

    out = _attend(runtime, 0, step)  # degraded: nothing is published, the host attends
    assert sender.fallbacks_enqueued == [1, 2, 3, 4, 5, 6] and host.num_calls == 1
    assert torch.equal(out, torch.ones_like(out))
