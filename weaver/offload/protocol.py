"""The offload protocol between a hot engine and a cold engine: records, errors and the
interface every transport implements (docs/architecture.md, "Offload channel").

One task is in flight at a time per region: the hot side sends one layer's remote
sequences, waits for their attention output (o_proj needs it), then sends the next.

The protocol, over the region's bytes (layout.py). Sequence numbers are int64, start at 0
and never wrap (OverflowError first):
  hot  ``submit``: copy q (and, for a new batch, seq_lens and the block table) into the
       staging area, then ``Transport.publish``: write the task metadata stamped with the
       new seq, release-store ``task_seq = seq`` (the LAST store), wake the cold side.
  cold ``Transport.serve``: when ``task_seq > done_seq`` (acquire load), read the metadata
       and q, run the executor into the output staging, store the result word, then
       release-store ``done_seq = seq`` (the LAST store), wake the hot side.
  hot  ``Transport.wait_done``: once ``done_seq >= seq`` the output staging holds the result.

The two sides of a pair are written once (sender.py, receiver.py); a transport says how
the counters move:
- shm.py (CPU): the region is POSIX shared memory, the counters are read and written by
  the host, the doorbells are FIFOs; the cold side serves a task on the host with an
  executor (a Python callable over tensor views).
- cuda/transport.py: the region is cold-device memory shared through CUDA IPC; a kernel
  on the hot stream publishes, a one-thread spin kernel waits (the CPU never blocks), and
  the cold side's polling kernel serves the task on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from weaver.offload.layout import RegionLayout, TaskResult

if TYPE_CHECKING:  # torch is imported where tensors are made: naming and attaching stay light
    import torch


class OffloadError(RuntimeError):
    """Base of every error the offload channel raises to the hot side."""


class OffloadTimeout(OffloadError):
    """The cold side did not answer in time, or is closing/closed/dead.

    The hot side should fall back to computing the attention locally (a failed or slow
    cold side is a logged fallback, never a hang).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "timeout" | "busy" | "closed" | "dead"


class OffloadTaskFailed(OffloadError):
    """The cold side ran the task and its executor raised; see the cold side's log."""


class WaitStatus(IntEnum):
    """How a wait for a task ended (csrc/offload_region.cuh WaitStatus, values 0-5)."""

    PENDING = 0  # a device wait that has not run yet (CUDA: read it after a sync)
    OK = 1
    FAILED = 2  # the cold side ran the task and flagged it (executor error, bad metadata)
    TIMEOUT = 3
    CLOSED = 4  # the cold side is closing or closed
    PROTOCOL_ERROR = 5  # done_seq passed the awaited seq: the ticket is stale
    DEAD = 6  # the cold process is gone (seen from the host only: a pid check)


@dataclass(frozen=True)
class TaskMeta:
    """What a task's metadata words hold besides its sequence number (layout.META_*)."""

    layer: int
    num_seqs: int
    scale: float
    sliding_window: int = -1  # -1 = none (vLLM's convention)
    softcap: float = 0.0  # 0.0 = none


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
    status: WaitStatus  # OK, or PENDING for a device wait (OffloadSender.settle)
    wait_s: float  # time spent inside wait()
    round_trip_s: float  # publish -> completion observed (host clock)
    num_sleeps: int  # doorbell sleeps taken by a host wait (0 = answered during the spin)


@dataclass
class OffloadTask:
    """One decode-attention task as a host executor sees it (views, no copies)."""

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


# A host executor runs one task, writing task.out. A transport that serves tasks on the
# device takes its own kind of executor (cuda/transport.py CudaPollingExecutor).
Executor = Callable[[OffloadTask], None]


@dataclass(frozen=True, eq=False)
class TaskBatch:
    """The remote sequences of one hot step, checked once (OffloadSender.prepare_batch).
    Every layer of the step sends the same batch, so submit_batch copies it into the
    staging area only when another batch is there."""

    seq_lens: torch.Tensor  # int32 [num_seqs], a private copy: nobody changes it after the check
    block_table: torch.Tensor  # int32 [num_seqs, n], likewise

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class WaitPolicy:
    """How the hot side waits for a completion.

    spin_s: a host wait spins this long before sleeping on the done doorbell (a fast cold
    side answers within it; longer spinning would steal the cold engine's core).
    liveness_check_s: how often a sleeping host wait re-checks the cold side's status/pid.
    backoff_ns: a device wait's pause between polls (0: poll back to back).
    """

    spin_s: float = 50e-6
    liveness_check_s: float = 0.05
    backoff_ns: int = 0

    def __post_init__(self) -> None:
        if self.spin_s < 0 or self.liveness_check_s <= 0 or self.backoff_ns < 0:
            raise ValueError("spin_s and backoff_ns must be >= 0 and liveness_check_s > 0")


@dataclass
class RegionViews:
    """Typed tensor views over a region's staging and KV sections; no copies."""

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    kv_layers: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def over(cls, transport: Transport) -> RegionViews:
        import torch

        layout = transport.layout
        tensor = transport.tensor
        dtype = layout.shape.torch_dtype
        max_seqs = layout.max_seqs_per_task
        return cls(
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


class RegionBase:
    """What every transport knows of its region (a base class of both): the layout, the
    name, whether this side owns it, and the bounds every view and word access keeps."""

    def __init__(self, layout: RegionLayout, name: str, is_owner: bool) -> None:
        self._layout = layout
        self._name = name
        self._is_owner = is_owner

    @property
    def name(self) -> str:
        return self._name

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    def _check_range(self, offset: int, num_bytes: int) -> None:
        if offset < 0 or offset + num_bytes > self._layout.total_bytes:
            raise ValueError(
                f"view [{offset}, {offset + num_bytes}) outside region of "
                f"{self._layout.total_bytes} bytes"
            )

    @staticmethod
    def _check_word(offset: int, fmt: str) -> None:
        if fmt not in ("q", "d") or offset % 8:
            raise ValueError(
                f"words need fmt 'q' or 'd' and an 8-byte aligned offset, got {fmt!r} at {offset}"
            )


class Transport(Protocol):
    """One mapped region and how its counters move (shm.py on CPU, cuda/transport.py).

    The hot side attaches, the cold side creates and owns the region. Counter operations
    follow the caller's order: on CPU they run now; on CUDA they are enqueued on the
    caller's current stream, after the staging copies it enqueued before.
    """

    @property
    def name(self) -> str: ...

    @property
    def is_owner(self) -> bool: ...

    @property
    def layout(self) -> RegionLayout: ...

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view (no copy) of the region at a byte offset: staging, KV pool."""
        ...

    def read_word(self, offset: int, fmt: str = "q") -> int | float:
        """One 8-byte header word, read by the host: "q" int64 or "d" float64 (on CUDA a
        synchronising read: for start-up, shutdown and error paths only)."""
        ...

    def write_word(self, offset: int, value: int | float, fmt: str = "q") -> None:
        """Store one 8-byte header word from the host (status, owner pid, heartbeat)."""
        ...

    # --- hot side -------------------------------------------------------------------
    def publish(self, seq: int, meta: TaskMeta, stamp: torch.Tensor | None = None) -> None:
        """Write the metadata, release-store task_seq = seq, wake the cold side. stamp: an
        int64 tensor that gets the publish time in ns (the device clock on CUDA)."""
        ...

    def wait_done(self, seq: int, timeout_s: float, policy: WaitPolicy,
                  stamp: torch.Tensor | None = None) -> tuple[WaitStatus, int]:
        """Until done_seq >= seq, the cold side closes or dies, or timeout_s passes: the
        status and the doorbell sleeps taken. A device wait is only enqueued and returns
        PENDING; its outcome comes from wait_status()."""
        ...

    def wait_status(self) -> tuple[WaitStatus, int]:
        """The outcome of the last wait_done and its number of polls (CUDA: synchronises the
        caller's stream)."""
        ...

    def enqueue_fallback(self, meta: TaskMeta) -> torch.Tensor:
        """After a device wait, on its stream: attend the staged task on the hot side if
        that wait did not end OK, and return the task's output, the cold side's or the
        fallback's as the wait ended (CUDA); a host wait ends with its outcome instead, so
        a host transport raises TypeError."""
        ...

    def take_num_fallbacks(self) -> int:
        """Fallbacks enqueue_fallback ran since the last call (CUDA: synchronises; once per
        step); 0 on a host transport, whose fallbacks are counted where they run."""
        ...

    def is_peer_open(self) -> bool:
        """False once the cold side is closing or closed, where the host can tell cheaply
        (CPU); a device transport answers True and its device wait reports CLOSED."""
        ...

    # --- cold side ------------------------------------------------------------------
    def has_pending(self) -> bool:
        """A task is published and not yet served (CUDA: a synchronising read)."""
        ...

    def may_have_task(self) -> bool:
        """False only when no task is pending for sure, at the cost a poll point can pay
        after every operator (CPU: one int64 compare; CUDA: True, its polling kernel
        returns at once when idle)."""
        ...

    def serve(self, executor: object, on_served: Callable[[TaskResult], None]) -> bool:
        """Serve the pending task, if there is one, with executor; call on_served with its
        result, then publish its completion. True if a task was served where the host can
        see it; a device transport launches its polling kernel and returns False (the
        device counts what it served)."""
        ...

    def wait_for_task(self, timeout_s: float) -> bool:
        """Sleep until a task may be pending or timeout_s passes (no busy wait); True if woken."""
        ...

    def wake_waiters(self) -> None:
        """Wake a sleeping wait on either side at once (closing, stopping a poller)."""
        ...

    def close(self) -> None:
        """Unmap; the owner also removes the region. Safe to call twice."""
        ...


def check_task_bounds(layout: RegionLayout, seq_lens: np.ndarray, block_table: np.ndarray) -> str:
    """Why a task would read outside the KV pool ("" if it would not).

    vLLM's kernel trusts seq_lens and block ids, so both sides check: the hot side to
    give its caller a ValueError, the cold side so that a buggy or stale hot process
    cannot make the cold engine read outside its pool. numpy, not torch: ~10x less
    overhead on these tiny arrays, and this runs once per step.
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
