"""The offload protocol, written once over any RegionTransport (architecture.md part 4).

One task is in flight at a time per region: the hot side sends one layer's remote
sequences, waits for their attention output (o_proj needs it), then sends the next.

Protocol (sequence numbers are int64, start at 0, and never wrap: OverflowError first):
  hot  ``submit``: copy q into staging, write metadata (stamped with the new seq), then
       store ``task_seq = seq`` -- the publish is the LAST store -- then ring the task
       doorbell.
  cold ``poll``: if ``task_seq > done_seq``: read metadata and q, run the executor into
       the output staging, store the result word, then ``done_seq = seq`` (LAST store),
       then ring the done doorbell.
  hot  ``wait``: once ``done_seq >= seq`` the output staging holds the result.

Memory ordering. The counters are 8-byte aligned words accessed through memoryview
items (CPython packs them with a fixed-size 8-byte memcpy, i.e. one mov), so each load or
store is single-copy atomic on x86-64 and AArch64. On x86 (TSO) stores are not reordered
with older stores and loads not with older loads, so "data, then counter" on one side
and "counter, then data" on the other is release/acquire for free. Every store here is
a separate C call (memoryview item store, torch copy_), so neither CPython nor the C
compiler can move one past another; torch's own worker threads finish (an OpenMP join,
itself a barrier) before copy_ or the kernel returns. The doorbell write is a syscall,
a full barrier anyway.
A weaker-ordered CPU (AArch64, POWER) would need a release fence (``dmb ish``/``stlr``)
before the counter store and an acquire fence (``ldar``/``dmb ishld``) after the counter
load; Python has no portable fence, so a port must add a tiny C helper for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from weaver.offload.layout import (
    DONE_RESULT_OFFSET,
    DONE_SEQ_OFFSET,
    HEARTBEAT_OFFSET,
    INT64_MAX,
    META_LAYER,
    META_NUM_FLOAT_WORDS,
    META_NUM_INT_WORDS,
    META_NUM_SEQS,
    META_SCALE,
    META_SLIDING_WINDOW,
    META_SOFTCAP,
    META_TASK_SEQ,
    OWNER_PID_OFFSET,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    RegionLayout,
    RegionStatus,
    TaskResult,
)
from weaver.offload.shm_transport import is_process_alive
from weaver.offload.transport import RegionTransport

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class OffloadError(RuntimeError):
    """Base of every error the offload channel raises to the hot side."""


class OffloadTimeout(OffloadError):
    """The cold side did not answer in time, or is closing/closed/dead.

    The hot side should fall back to computing the attention locally (architecture.md
    invariant: a failed or slow cold side is a logged fallback, never a hang).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "timeout" | "busy" | "closed" | "dead"


class OffloadTaskFailed(OffloadError):
    """The cold side ran the task and its executor raised; see the cold side's log."""


@dataclass(frozen=True)
class OffloadTicket:
    seq: int
    layer: int
    num_seqs: int
    submitted_at: float  # time.monotonic() after the publish


@dataclass(frozen=True)
class OffloadResult:
    """Output view plus timing, for the wait-time histogram of a metrics layer."""

    output: torch.Tensor  # [num_seqs, num_q_heads, head_size], valid until the next submit
    ticket: OffloadTicket
    wait_s: float  # time spent inside wait()
    round_trip_s: float  # publish -> completion observed
    num_sleeps: int  # doorbell sleeps taken (0 = answered during the spin)


@dataclass
class OffloadTask:
    """One decode-attention task as the cold side's executor sees it (views, no copies)."""

    seq: int
    layer: int
    q: torch.Tensor  # [num_seqs, num_q_heads, head_size]
    out: torch.Tensor  # same shape; the executor writes the result here
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], ids local to the pool
    kv_layer: torch.Tensor  # [num_remote_blocks, num_kv_heads, block_size, 2*head_size]
    scale: float
    sliding_window: int  # -1 = none
    softcap: float  # 0.0 = none

    @property
    def num_seqs(self) -> int:
        return self.q.shape[0]


Executor = Callable[[OffloadTask], None]


@dataclass(frozen=True, eq=False)
class TaskBatch:
    """The remote sequences of one hot step, checked against the region's layout once
    (OffloadSender.prepare_batch). Every layer of the step sends the same batch, so
    submit_batch copies it into the staging area only when another batch is there."""

    seq_lens: torch.Tensor  # int32 [num_seqs], a private copy: nobody changes it after the check
    block_table: torch.Tensor  # int32 [num_seqs, n], likewise

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class SenderStats:
    num_submitted: int = 0
    num_completed: int = 0
    num_timeouts: int = 0
    num_failed: int = 0
    total_wait_s: float = 0.0


@dataclass
class ReceiverStats:
    num_served: int = 0
    num_failed: int = 0
    num_served_at_poll_points: int = 0
    num_served_by_idle_poller: int = 0
    num_idle_wakeups: int = 0
    total_busy_s: float = 0.0
    # Split by where the task was served: at poll points the time lands inside one of
    # the cold model's own steps (what its TPOT pays); by the idle poller it does not.
    busy_at_poll_points_s: float = 0.0
    busy_by_idle_poller_s: float = 0.0


@dataclass
class _RegionViews:
    """Typed views over the region's bytes; no copies."""

    task_seq: memoryview  # int64 words ("q") and float64 words ("d")
    done_seq: memoryview
    done_result: memoryview
    status: memoryview
    owner_pid: memoryview
    heartbeat: memoryview
    meta_ints: memoryview
    meta_floats: memoryview
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    kv_layers: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def over(cls, transport: RegionTransport) -> _RegionViews:
        layout: RegionLayout = transport.layout
        words, tensor = transport.words, transport.tensor
        dtype = TORCH_DTYPES[layout.shape.dtype]
        max_seqs = layout.max_seqs_per_task
        return cls(
            task_seq=words(TASK_SEQ_OFFSET, 1),
            done_seq=words(DONE_SEQ_OFFSET, 1),
            done_result=words(DONE_RESULT_OFFSET, 1),
            status=words(STATUS_OFFSET, 1),
            owner_pid=words(OWNER_PID_OFFSET, 1),
            heartbeat=words(HEARTBEAT_OFFSET, 1, "d"),
            meta_ints=words(layout.meta_offset, META_NUM_INT_WORDS),
            meta_floats=words(layout.meta_floats_offset, META_NUM_FLOAT_WORDS, "d"),
            seq_lens=tensor(layout.seq_lens_offset, (max_seqs,), torch.int32),
            block_table=tensor(
                layout.block_table_offset, (max_seqs, layout.max_blocks_per_seq), torch.int32
            ),
            q=tensor(layout.q_offset, layout.staging_shape, dtype),
            out=tensor(layout.out_offset, layout.staging_shape, dtype),
            # No KV section when the remote blocks live in the unified pool (kv_in_pool).
            kv_layers=[
                tensor(layout.kv_layer_offset(i), layout.kv_layer_shape, dtype)
                if not layout.kv_in_pool else torch.empty(layout.kv_layer_shape, dtype=dtype)
                for i in range(layout.shape.num_layers)
            ],
        )


class OffloadSender:
    """Hot side of one region: submit one layer's remote sequences, wait for the output.

    spin_s: a short bounded spin before sleeping on the done doorbell (a fast cold side
    answers within it; longer spinning would steal the cold engine's core).
    liveness_check_s: how often a waiting sender re-checks the cold side's status/pid.
    """

    def __init__(
        self,
        transport: RegionTransport,
        *,
        spin_s: float = 50e-6,
        liveness_check_s: float = 0.05,
    ) -> None:
        if spin_s < 0 or liveness_check_s <= 0:
            raise ValueError("spin_s must be >= 0 and liveness_check_s > 0")
        self._transport = transport
        self._layout = transport.layout
        self._views = _RegionViews.over(transport)
        self._spin_s = spin_s
        self._liveness_check_s = liveness_check_s
        self._torch_dtype = TORCH_DTYPES[self._layout.shape.dtype]
        self._staged: TaskBatch | None = None  # the batch in the staging area (held)
        self.stats = SenderStats()

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    def kv_layer(self, layer: int) -> torch.Tensor:
        """The remote pool of one hot layer (CPU_ATTN view) for writing new K/V."""
        self._layout.kv_layer_offset(layer)  # range check
        return self._views.kv_layers[layer]

    def peer_heartbeat_age_s(self) -> float:
        """Seconds since the cold side's idle poller last ticked (time.monotonic is
        CLOCK_MONOTONIC, one clock for every process of a Linux host)."""
        return time.monotonic() - float(self._views.heartbeat[0])

    def can_submit(self) -> bool:
        """False while an earlier task (e.g. one that timed out) is still being served."""
        v = self._views
        return int(v.done_seq[0]) == int(v.task_seq[0]) and self._is_peer_open()

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
    ) -> OffloadTicket:
        """Publish one decode-attention task for `layer` (prepare_batch + submit_batch).

        q: [num_seqs, num_q_heads, head_size] in the region dtype; seq_lens and block_table
        as for prepare_batch. The new token's K/V must already be in the pool.
        """
        return self.submit_batch(layer, q, self.prepare_batch(seq_lens, block_table),
                                 scale=scale, sliding_window=sliding_window, softcap=softcap)

    def submit_batch(
        self,
        layer: int,
        q: torch.Tensor,
        batch: TaskBatch,
        *,
        scale: float,
        sliding_window: int = -1,
        softcap: float = 0.0,
    ) -> OffloadTicket:
        """Publish one decode-attention task for `layer` over a prepared batch. A hot step
        sends one batch for each of its layers: only the first copies it into the staging
        area (the bounds check and those copies were half of a submit's cost)."""
        v = self._views
        if v is None:
            raise ValueError("this OffloadSender is closed; attach a new one")
        self._validate(layer, q, batch.num_seqs)
        if not self._is_peer_open():
            raise OffloadTimeout(
                f"cold side of {self._transport.name!r} is {self._peer_status().name}", "closed"
            )
        published = int(v.task_seq[0])
        if int(v.done_seq[0]) != published:
            raise OffloadTimeout(
                f"task {published} on {self._transport.name!r} is still being served "
                "(an earlier wait timed out); compute this layer locally",
                "busy",
            )
        if published >= INT64_MAX:
            raise OverflowError("offload task sequence number would overflow int64")
        seq = published + 1
        num_seqs = batch.num_seqs
        v.q[:num_seqs].copy_(q)
        if self._staged is not batch:
            self._staged = None  # until all of it is in place
            num_blocks = batch.block_table.shape[1]
            v.seq_lens[:num_seqs].copy_(batch.seq_lens)
            v.block_table[:num_seqs, :num_blocks].copy_(batch.block_table)
            if num_blocks < self._layout.max_blocks_per_seq:
                v.block_table[:num_seqs, num_blocks:].zero_()
            self._staged = batch
        v.meta_ints[META_LAYER] = int(layer)
        v.meta_ints[META_NUM_SEQS] = int(num_seqs)
        v.meta_ints[META_SLIDING_WINDOW] = int(sliding_window)
        v.meta_floats[META_SCALE] = float(scale)
        v.meta_floats[META_SOFTCAP] = float(softcap)
        v.meta_ints[META_TASK_SEQ] = seq
        v.task_seq[0] = seq  # publish: the LAST store (see module docstring)
        self._transport.task_wakeup.notify()
        self.stats.num_submitted += 1
        return OffloadTicket(seq, layer, num_seqs, time.monotonic())

    def wait(self, ticket: OffloadTicket, timeout_s: float) -> torch.Tensor:
        """Output view [num_seqs, num_q_heads, head_size]; copy it before the next submit."""
        return self.wait_with_timing(ticket, timeout_s).output

    def wait_with_timing(self, ticket: OffloadTicket, timeout_s: float) -> OffloadResult:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        v = self._views
        start = time.monotonic()
        deadline = start + timeout_s
        spin_until = start + self._spin_s
        num_sleeps = 0
        while v.done_seq[0] < ticket.seq:
            now = time.monotonic()
            if now < spin_until:
                continue
            if now >= deadline:
                self.stats.num_timeouts += 1
                raise OffloadTimeout(
                    f"offload task {ticket.seq} (layer {ticket.layer}) on "
                    f"{self._transport.name!r} not done after {timeout_s:.3f}s",
                    "timeout",
                )
            self._raise_if_peer_gone(ticket)
            self._transport.done_wakeup.wait(min(deadline - now, self._liveness_check_s))
            num_sleeps += 1
        done = int(v.done_seq[0])
        if done != ticket.seq:
            raise OffloadError(
                f"ticket {ticket.seq} is stale: task {done} has since reused the staging area"
            )
        end = time.monotonic()
        self.stats.total_wait_s += end - start
        if int(v.done_result[0]) != TaskResult.OK:
            self.stats.num_failed += 1
            raise OffloadTaskFailed(
                f"cold side failed offload task {ticket.seq} (layer {ticket.layer}); "
                "see the cold engine's log"
            )
        self.stats.num_completed += 1
        return OffloadResult(
            output=v.out[: ticket.num_seqs],
            ticket=ticket,
            wait_s=end - start,
            round_trip_s=end - ticket.submitted_at,
            num_sleeps=num_sleeps,
        )

    def close(self) -> None:
        self._views = None  # type: ignore[assignment]  # drop exports before unmapping
        self._transport.close()

    # --- helpers ------------------------------------------------------------------
    def _peer_status(self) -> RegionStatus:
        return RegionStatus(int(self._views.status[0]))

    def _is_peer_open(self) -> bool:
        return self._peer_status() in (RegionStatus.INITIALIZING, RegionStatus.ALIVE)

    def _raise_if_peer_gone(self, ticket: OffloadTicket) -> None:
        if not self._is_peer_open():
            self.stats.num_timeouts += 1
            raise OffloadTimeout(
                f"cold side of {self._transport.name!r} is {self._peer_status().name} "
                f"while task {ticket.seq} was pending",
                "closed",
            )
        pid = int(self._views.owner_pid[0])
        if not is_process_alive(pid):
            self.stats.num_timeouts += 1
            raise OffloadTimeout(
                f"cold side of {self._transport.name!r} (pid {pid}) died while task "
                f"{ticket.seq} was pending",
                "dead",
            )

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


def check_task_bounds(layout: RegionLayout, seq_lens: np.ndarray, block_table: np.ndarray) -> str:
    """Why a task would read outside the KV pool ("" if it would not).

    vLLM's kernel trusts seq_lens and block ids, so both sides check: the hot side to
    give its caller a ValueError, the cold side so that a buggy or stale hot process
    cannot make the cold engine read outside its pool. numpy, not torch: ~10x less
    overhead on these tiny arrays, and this runs once per layer per step.
    """
    block_size = layout.shape.block_size
    num_blocks = block_table.shape[1]
    min_len, max_len = int(seq_lens.min()), int(seq_lens.max())
    if min_len < 1 or max_len > num_blocks * block_size:
        return (
            f"seq_lens must be in [1, {num_blocks * block_size}] for a block table "
            f"of {num_blocks} blocks of {block_size}; got [{min_len}, {max_len}]"
        )
    used = _used_block_ids(seq_lens, block_table, block_size)
    if used.size and (int(used.min()) < 0 or int(used.max()) >= layout.num_remote_blocks):
        return (
            f"block ids must be in [0, {layout.num_remote_blocks}) (local to the remote pool: "
            "subtract the first remote block id)"
        )
    return ""


def _used_block_ids(seq_lens: np.ndarray, block_table: np.ndarray, block_size: int) -> np.ndarray:
    """Block ids a sequence actually reads; later columns are padding, as in vLLM."""
    num_used = (seq_lens.astype(np.int64) + block_size - 1) // block_size
    return block_table[np.arange(block_table.shape[1])[None, :] < num_used[:, None]]


class OffloadReceiver:
    """Cold side of one region: serve tasks at poll points and from an idle poller.

    executor: runs one OffloadTask, writing task.out (e.g. CpuPagedAttentionExecutor); if it
    has a release() method, close() calls it before the region is unmapped.
    idle_wait_s: the idle poller's longest sleep between heartbeats; tasks wake it at once.
    """

    def __init__(
        self,
        transport: RegionTransport,
        executor: Executor,
        *,
        idle_wait_s: float = 0.05,
    ) -> None:
        if not transport.is_owner:
            raise ValueError("OffloadReceiver needs the region's owner (ShmRegion.create)")
        if idle_wait_s <= 0:
            raise ValueError(f"idle_wait_s must be > 0, got {idle_wait_s}")
        self._transport = transport
        self._layout = transport.layout
        self._executor = executor
        self._idle_wait_s = idle_wait_s
        self._views = _RegionViews.over(transport)
        self._done_seq = int(self._views.done_seq[0])
        # The bytes of the last staged batch (seq_lens, block table) that passed the bounds
        # check: the layers of one hot step send the same batch, checked once here too.
        self._checked_batch: bytes | None = None
        # One lock: a poll point (model thread) only tries it; the idle thread blocks on it.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self.stats = ReceiverStats()
        self._views.owner_pid[0] = os.getpid()
        self._views.heartbeat[0] = time.monotonic()
        self._views.status[0] = int(RegionStatus.ALIVE)

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    def kv_layer(self, layer: int) -> torch.Tensor:
        self._layout.kv_layer_offset(layer)
        return self._views.kv_layers[layer]

    def has_pending(self) -> bool:
        return int(self._views.task_seq[0]) > self._done_seq

    def poll(self, *, by_idle_poller: bool = False) -> bool:
        """Serve a pending task now if no other thread is serving; True if one was served.

        Called between every cold operator, so the idle case is one int64 load and compare.
        by_idle_poller: the caller is an idle loop of its own (the worker extension's, which
        also takes the engine's step lock), not a poll point; it only changes the stats.
        """
        views = self._views
        if views is None or views.task_seq[0] <= self._done_seq:
            return False  # closed, or nothing pending
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._serve_pending_locked(by_idle_poller=by_idle_poller)
        finally:
            self._lock.release()

    def start_idle_poller(self) -> None:
        if self._thread is not None:
            return
        self._stop_event.clear()
        self._thread = threading.Thread(
            target=self._idle_loop, name=f"weaver-offload-{self._transport.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the idle poller (poll() keeps working)."""
        thread = self._thread
        if thread is None:
            return
        self._stop_event.set()
        self._transport.task_wakeup.notify()  # wake it from select()
        thread.join()
        self._thread = None

    def close(self) -> None:
        """Tell the hot side we are going (its waits fail fast), stop, remove the region."""
        if self._views is None:
            return
        self._views.status[0] = int(RegionStatus.CLOSING)
        self._transport.done_wakeup.notify()
        self.stop()
        release = getattr(self._executor, "release", None)
        with self._lock:
            if release is not None:
                release()  # an executor may keep views of the region between tasks
            self._views.status[0] = int(RegionStatus.CLOSED)
            self._transport.done_wakeup.notify()
            self._views = None  # type: ignore[assignment]  # drop exports before unmapping
        self._transport.close()

    # --- internals ----------------------------------------------------------------
    def _idle_loop(self) -> None:
        wakeup = self._transport.task_wakeup
        while not self._stop_event.is_set():
            woke = wakeup.wait(self._idle_wait_s)
            if self._stop_event.is_set():
                break
            self._views.heartbeat[0] = time.monotonic()
            if woke:
                self.stats.num_idle_wakeups += 1
            if not self.has_pending():
                continue
            with self._lock:
                self._serve_pending_locked(by_idle_poller=True)

    def _serve_pending_locked(self, *, by_idle_poller: bool) -> bool:
        v = self._views
        seq = int(v.task_seq[0])  # acquire side: read the counter before the data
        if seq <= self._done_seq:
            return False
        start = time.monotonic()
        result = TaskResult.OK
        try:
            if seq != self._done_seq + 1:
                raise OffloadError(f"task_seq jumped from {self._done_seq} to {seq}")
            self._executor(self._read_task(seq))
        except Exception:
            logger.exception("offload task %d on %s failed", seq, self._transport.name)
            result = TaskResult.FAILED
            self.stats.num_failed += 1
        # Counters first, so a hot side that sees the completion also sees them counted.
        busy_s = time.monotonic() - start
        self.stats.num_served += 1
        if by_idle_poller:
            self.stats.num_served_by_idle_poller += 1
            self.stats.busy_by_idle_poller_s += busy_s
        else:
            self.stats.num_served_at_poll_points += 1
            self.stats.busy_at_poll_points_s += busy_s
        self.stats.total_busy_s += busy_s
        v.done_result[0] = int(result)
        v.done_seq[0] = seq  # publish completion: the LAST store
        self._done_seq = seq
        self._transport.done_wakeup.notify()
        return True

    def _read_task(self, seq: int) -> OffloadTask:
        v = self._views
        lay = self._layout
        meta_seq = int(v.meta_ints[META_TASK_SEQ])
        if meta_seq != seq:
            raise OffloadError(f"metadata belongs to task {meta_seq}, expected {seq}")
        layer = int(v.meta_ints[META_LAYER])
        num_seqs = int(v.meta_ints[META_NUM_SEQS])
        if not 0 <= layer < lay.shape.num_layers or not 1 <= num_seqs <= lay.max_seqs_per_task:
            raise OffloadError(f"task {seq}: bad layer {layer} or num_seqs {num_seqs}")
        seq_lens, block_table = v.seq_lens[:num_seqs].numpy(), v.block_table[:num_seqs].numpy()
        # Compared as bytes (a copy of a few hundred bytes), not trusted as "the same
        # batch": whatever the staging area holds now is what the kernel will read.
        staged = seq_lens.tobytes() + block_table.tobytes()
        if staged != self._checked_batch:
            error = check_task_bounds(lay, seq_lens, block_table)
            if error:
                raise OffloadError(f"task {seq} rejected: {error}")
            self._checked_batch = staged
        return OffloadTask(
            seq=seq,
            layer=layer,
            q=v.q[:num_seqs],
            out=v.out[:num_seqs],
            seq_lens=v.seq_lens[:num_seqs],
            block_table=v.block_table[:num_seqs],
            kv_layer=v.kv_layers[layer],
            scale=float(v.meta_floats[META_SCALE]),
            sliding_window=int(v.meta_ints[META_SLIDING_WINDOW]),
            softcap=float(v.meta_floats[META_SOFTCAP]),
        )
