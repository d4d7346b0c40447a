"""The hot side of one offload region: submit one layer's remote sequences, wait for the
output (protocol.py), over any transport.

On CPU a wait blocks until the output is there and raises when the cold side failed. On
CUDA the wait is a kernel enqueued on the hot stream: the output view is valid in stream
order, and ``settle`` (a synchronisation) raises if that wait did not end OK.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from weaver.offload.layout import (
    DONE_SEQ_OFFSET,
    INT64_MAX,
    OPEN_STATUSES,
    OWNER_PID_OFFSET,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    RegionLayout,
    RegionStatus,
)
from weaver.offload.protocol import (
    OffloadError,
    OffloadResult,
    OffloadTaskFailed,
    OffloadTicket,
    OffloadTimeout,
    RegionViews,
    TaskBatch,
    TaskMeta,
    Transport,
    WaitPolicy,
    WaitStatus,
    check_task_bounds,
)


@dataclass
class SenderStats:
    num_submitted: int = 0
    num_completed: int = 0
    num_timeouts: int = 0
    num_failed: int = 0
    total_wait_s: float = 0.0


class OffloadSender:
    """Hot side of one region. One task is in flight at a time: a task whose wait failed
    (timed out) keeps the region busy until the cold side has finished it (``recover``)."""

    def __init__(self, transport: Transport, *, policy: WaitPolicy | None = None) -> None:
        self._transport = transport
        self._layout = transport.layout
        self._views: RegionViews | None = RegionViews.over(transport)
        self._policy = policy or WaitPolicy()
        self._torch_dtype = self._layout.shape.torch_dtype
        self._staged: TaskBatch | None = None  # the batch in the staging area (held)
        self._last_meta: TaskMeta | None = None  # of the last task published
        self._last_seq = int(transport.read_word(TASK_SEQ_OFFSET))
        # A task of an earlier sender may still be served (a hot engine that restarted).
        self._is_in_flight = int(transport.read_word(DONE_SEQ_OFFSET)) != self._last_seq
        self.stats = SenderStats()

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def policy(self) -> WaitPolicy:
        return self._policy

    def kv_layer(self, layer: int) -> torch.Tensor:
        """The remote pool of one hot layer ([num_blocks, num_kv_heads, block_size, 2*D])
        for writing new K/V."""
        self._layout.kv_layer_offset(layer)  # range check
        return self._open_views().kv_layers[layer]

    def recover(self) -> bool:
        """True once no task is in flight: the cold side has finished the last one (a host
        read of done_seq; on CUDA a synchronisation, so only on the failure path)."""
        if self._is_in_flight and int(self._transport.read_word(DONE_SEQ_OFFSET)) >= self._last_seq:
            self._is_in_flight = False
        return not self._is_in_flight

    def is_idle_and_open(self) -> bool:
        """True when the cold side is open and has finished every task published to it,
        read now from the region (a device wait clears the in-flight mark without knowing;
        a synchronising read on CUDA: for a degraded pair's retry, not the hot path)."""
        if int(self._transport.read_word(DONE_SEQ_OFFSET)) < self._last_seq:
            return False
        self._is_in_flight = False
        return self._peer_status() in OPEN_STATUSES

    def can_submit(self) -> bool:
        """False while an earlier task (e.g. one that timed out) is still being served or
        the cold side is closing."""
        return self.recover() and self._transport.is_peer_open()

    def prepare_batch(self, seq_lens: torch.Tensor, block_table: torch.Tensor) -> TaskBatch:
        """Check one step's remote sequences against the pool and keep a private copy.

        seq_lens: [num_seqs] tokens including the new one; block_table: [num_seqs, n]
        remote block ids local to the pool (n <= max_blocks_per_seq)."""
        lay = self._layout
        num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        if not 1 <= num_seqs <= lay.max_seqs_per_task:
            raise ValueError(
                f"seq_lens must be [num_seqs] with num_seqs in [1, {lay.max_seqs_per_task}], "
                f"got {tuple(seq_lens.shape)}; split the batch or raise max_seqs_per_task"
            )
        if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
            raise ValueError(f"block_table must be [{num_seqs}, n], got {tuple(block_table.shape)}")
        if block_table.shape[1] > lay.max_blocks_per_seq:
            raise ValueError(
                f"block_table has {block_table.shape[1]} columns > max_blocks_per_seq "
                f"{lay.max_blocks_per_seq}"
            )
        batch = TaskBatch(seq_lens.to(torch.int32, copy=True),
                          block_table.to(torch.int32, copy=True))
        if batch.seq_lens.device.type == "cpu":
            # A device batch is checked by the cold kernel instead (a bad id fails the
            # task): checking it here would need a synchronisation.
            error = check_task_bounds(lay, batch.seq_lens.numpy(), batch.block_table.numpy())
            if error:
                raise ValueError(error)
        return batch

    def submit(
        self,
        layer: int,
        q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        scale: float,
        sliding_window: int = -1,
        softcap: float = 0.0,
        stamp: torch.Tensor | None = None,
    ) -> OffloadTicket:
        """Publish one decode-attention task for `layer` (prepare_batch + submit_batch).

        q: [num_seqs, num_q_heads, head_size] in the region dtype; seq_lens and block_table
        as for prepare_batch. The new token's K/V must already be in the pool.
        """
        return self.submit_batch(layer, q, self.prepare_batch(seq_lens, block_table),
                                 scale=scale, sliding_window=sliding_window, softcap=softcap,
                                 stamp=stamp)

    def submit_batch(
        self,
        layer: int,
        q: torch.Tensor,
        batch: TaskBatch,
        *,
        scale: float,
        sliding_window: int = -1,
        softcap: float = 0.0,
        stamp: torch.Tensor | None = None,
    ) -> OffloadTicket:
        """Publish one decode-attention task for `layer` over a prepared batch. A hot step
        sends one batch for each of its layers: only the first copies it into the staging
        area (the bounds check and those copies were half of a submit's cost)."""
        views = self._open_views()
        self._validate(layer, q, batch.num_seqs)
        if not (self._transport.is_peer_open() and self.recover()):
            # Off the hot path: a device transport's peer status is a synchronising read.
            status = self._peer_status()
            if status not in OPEN_STATUSES:
                raise OffloadTimeout(f"cold side of {self._transport.name!r} is {status.name}",
                                     "closed")
            raise OffloadTimeout(
                f"task {self._last_seq} on {self._transport.name!r} is still being served "
                "(an earlier wait timed out); compute this layer locally",
                "busy",
            )
        if self._last_seq >= INT64_MAX:
            raise OverflowError("offload task sequence number would overflow int64")
        seq = self._last_seq + 1
        num_seqs = batch.num_seqs
        views.q[:num_seqs].copy_(q, non_blocking=True)
        if self._staged is not batch:
            self._staged = None  # until all of it is in place
            num_blocks = batch.block_table.shape[1]
            views.seq_lens[:num_seqs].copy_(batch.seq_lens, non_blocking=True)
            views.block_table[:num_seqs, :num_blocks].copy_(batch.block_table, non_blocking=True)
            if num_blocks < self._layout.max_blocks_per_seq:
                # A host batch was checked (its lengths fit its columns): pad with vLLM's
                # null block 0. A device batch was not: -1 makes a length past its columns
                # fail the task instead of reading a stale id of an earlier batch.
                pad = 0 if batch.block_table.device.type == "cpu" else -1
                views.block_table[:num_seqs, num_blocks:].fill_(pad)
            self._staged = batch
        meta = TaskMeta(layer, num_seqs, float(scale), int(sliding_window), float(softcap))
        self._transport.publish(seq, meta, stamp)
        self._last_meta = meta
        self._last_seq = seq
        self._is_in_flight = True
        self.stats.num_submitted += 1
        return OffloadTicket(seq, layer, num_seqs, time.monotonic())

    def wait(self, ticket: OffloadTicket, timeout_s: float,
             stamp: torch.Tensor | None = None) -> torch.Tensor:
        """Output view [num_seqs, num_q_heads, head_size]; copy it before the next submit."""
        return self.wait_with_timing(ticket, timeout_s, stamp).output

    def wait_with_timing(self, ticket: OffloadTicket, timeout_s: float,
                         stamp: torch.Tensor | None = None) -> OffloadResult:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        views = self._open_views()
        if ticket.seq != self._last_seq:
            raise OffloadError(
                f"ticket {ticket.seq} is stale: task {self._last_seq} has since reused the "
                "staging area")
        start = time.monotonic()
        status, num_sleeps = self._transport.wait_done(ticket.seq, timeout_s, self._policy,
                                                       stamp)
        end = time.monotonic()
        self.stats.total_wait_s += end - start
        if status is WaitStatus.PENDING:
            # A device wait: the next publish follows it on the stream; settle() tells.
            self._is_in_flight = False
        else:
            self._raise_unless_ok(status, ticket, timeout_s)
        return OffloadResult(
            output=views.out[: ticket.num_seqs],
            ticket=ticket,
            status=status,
            wait_s=end - start,
            round_trip_s=end - ticket.submitted_at,
            num_sleeps=num_sleeps,
        )

    def enqueue_fallback(self, ticket: OffloadTicket) -> torch.Tensor:
        """After a device wait for `ticket` (status PENDING): the hot side attends the task
        itself, on its stream, if that wait does not end OK; returns the task's output
        either way (Transport.enqueue_fallback)."""
        if ticket.seq != self._last_seq or self._last_meta is None:
            raise OffloadError(f"ticket {ticket.seq} is stale: task {self._last_seq} has since "
                               "reused the staging area")
        return self._transport.enqueue_fallback(self._last_meta)

    def take_num_device_fallbacks(self) -> int:
        """Fallbacks run on the device since the last call (a synchronisation on CUDA)."""
        return self._transport.take_num_fallbacks()

    def settle(self, ticket: OffloadTicket) -> int:
        """Raise if the last wait (a device wait, enqueued by wait()) did not end OK;
        returns its number of polls. Synchronises the caller's stream on CUDA."""
        status, num_polls = self._transport.wait_status()
        if status is not WaitStatus.PENDING:
            self._raise_unless_ok(status, ticket, None)
        return num_polls

    def close(self) -> None:
        self._views = None  # drop the views before unmapping
        self._transport.close()

    # --- helpers ------------------------------------------------------------------
    def _open_views(self) -> RegionViews:
        if self._views is None:
            raise ValueError("this OffloadSender is closed; attach a new one")
        return self._views

    def _peer_status(self) -> RegionStatus:
        return RegionStatus(int(self._transport.read_word(STATUS_OFFSET)))

    def _raise_unless_ok(self, status: WaitStatus, ticket: OffloadTicket,
                         timeout_s: float | None) -> None:
        name = self._transport.name
        # The cold side is done with the task unless the wait ended before it was.
        self._is_in_flight = status not in (WaitStatus.OK, WaitStatus.FAILED,
                                            WaitStatus.PROTOCOL_ERROR)
        if status is WaitStatus.OK:
            self.stats.num_completed += 1
            return
        if status is WaitStatus.FAILED:
            self.stats.num_failed += 1
            raise OffloadTaskFailed(
                f"cold side failed offload task {ticket.seq} (layer {ticket.layer}); "
                "see the cold engine's log")
        if status is WaitStatus.PROTOCOL_ERROR:
            raise OffloadError(f"ticket {ticket.seq} is stale: a later task has since reused "
                               "the staging area")
        self.stats.num_timeouts += 1
        if status is WaitStatus.CLOSED:
            raise OffloadTimeout(f"cold side of {name!r} is {self._peer_status().name} while "
                                 f"task {ticket.seq} was pending", "closed")
        if status is WaitStatus.DEAD:
            pid = int(self._transport.read_word(OWNER_PID_OFFSET))
            raise OffloadTimeout(f"cold side of {name!r} (pid {pid}) died while task "
                                 f"{ticket.seq} was pending", "dead")
        after = f"after {timeout_s:.3f}s" if timeout_s is not None else "in time"
        raise OffloadTimeout(f"offload task {ticket.seq} (layer {ticket.layer}) on {name!r} "
                             f"not done {after}", "timeout")

    def _validate(self, layer: int, q: torch.Tensor, num_seqs: int) -> None:
        shape = self._layout.shape
        if not 0 <= layer < shape.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {shape.num_layers})")
        if q.dim() != 3 or tuple(q.shape) != (num_seqs, shape.num_q_heads, shape.head_size):
            raise ValueError(
                f"q must be [{num_seqs}, {shape.num_q_heads}, {shape.head_size}] (num_seqs "
                f"from seq_lens), got {tuple(q.shape)}"
            )
        if q.dtype != self._torch_dtype:
            raise ValueError(f"q dtype {q.dtype} != region dtype {shape.dtype}; cast it first")
