"""CUDA transport: the region in cold-device memory, device-side publish/wait/poll.

Same protocol and byte layout as the CPU transport (layout.py, channel.py); what changes
is who moves the counters (architecture.md part 4):
  hot  ``CudaOffloadSender.submit``: copies q, seq_lens and the block table into the
       region on the hot stream, then ``weaver_publish`` writes the metadata and
       release-stores task_seq; ``wait`` enqueues ``weaver_wait_done``, a one-thread spin
       kernel with a timeout, so the hot stream's next kernel (o_proj) starts when the
       output is there and the CPU never blocks.
  cold ``CudaOffloadReceiver.poll``: ``weaver_poll_and_attend`` after each cold operator
       (returns at once when task_seq == done_seq), or ``spin`` as a persistent server.

The region is one flat uint8 tensor allocated with torch on the cold device, exported
once with CUDA IPC (ipc.py) and opened once by the hot side; it never comes from vLLM's
KV pool. CudaRegion implements RegionTransport's name/is_owner/layout/close; it has no
host ``buffer`` or FIFO wakeups (the memory is on the device and the doorbells are the
spin kernels), so channel.OffloadSender/Receiver do not run on it.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weaver.offload.cuda.region_desc import WaitStatus, check_kernel_shape, region_descriptor
from weaver.offload.layout import (
    DONE_SEQ_OFFSET,
    HEADER_BYTES,
    INT64_MAX,
    OWNER_PID_OFFSET,
    REGION_MAGIC,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    RegionLayout,
    RegionStatus,
)

if TYPE_CHECKING:
    import torch

    from weaver.offload.cuda.jit import KernelLibrary

logger = logging.getLogger(__name__)


class CudaRegion:
    """One offload region in device memory. Create on the cold side, attach on the hot."""

    def __init__(self, layout: RegionLayout, name: str, tensor: torch.Tensor, is_owner: bool):
        self._layout = layout
        self._name = name
        self._tensor: torch.Tensor | None = tensor
        self._is_owner = is_owner

    @classmethod
    def create(cls, layout: RegionLayout, name: str, device: torch.device | str) -> CudaRegion:
        import torch

        check_kernel_shape(layout)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a CudaRegion lives on a CUDA device, got {device}")
        # Zeroed: the counters start at 0 and an untouched pool reads as zeros.
        tensor = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        header = bytearray(HEADER_BYTES)
        packed = layout.pack_header()
        header[: len(packed)] = packed
        struct.pack_into("<q", header, OWNER_PID_OFFSET, os.getpid())
        struct.pack_into("<q", header, STATUS_OFFSET, int(RegionStatus.INITIALIZING))
        tensor[:HEADER_BYTES].copy_(torch.frombuffer(header, dtype=torch.uint8))
        torch.cuda.synchronize(device)  # complete before the handle is exported
        logger.info(
            "created CUDA offload region %s (%d bytes on %s)", name, layout.total_bytes, device
        )
        return cls(layout, name, tensor, is_owner=True)

    @classmethod
    def attach(cls, layout: RegionLayout, name: str, handle: bytes) -> CudaRegion:
        """Open the owner's exported handle (once per process) and check the header."""
        from weaver.offload.cuda.ipc import open_tensor

        check_kernel_shape(layout)
        tensor = open_tensor(handle)
        if tensor.numel() != layout.total_bytes:
            raise ValueError(
                f"CUDA region {name!r} has {tensor.numel()} bytes, this side expects "
                f"{layout.total_bytes}; configure both sides with the same layout"
            )
        header = bytes(tensor[:HEADER_BYTES].cpu().numpy())
        if header[: len(REGION_MAGIC)] != REGION_MAGIC:
            raise ValueError(f"CUDA region {name!r} has no Weaver header; wrong handle?")
        layout.verify_header(header)
        return cls(layout, name, tensor, is_owner=False)

    def export_handle(self) -> bytes:
        """Bytes for the hot side's attach(); only the owner exports."""
        from weaver.offload.cuda.ipc import export_tensor

        if not self._is_owner:
            raise ValueError("only the region's owner (the cold side) exports its handle")
        return export_tensor(self.tensor)

    # --- RegionTransport subset -----------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"CUDA offload region {self._name!r} is closed")
        return self._tensor

    @property
    def is_closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        """Drop this process's reference (the owner frees the memory once no view is left)."""
        self._tensor = None

    # --- typed views ---------------------------------------------------------------
    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import math

        num_bytes = math.prod(shape) * dtype.itemsize
        return self.tensor[offset : offset + num_bytes].view(dtype).view(shape)

    def word(self, offset: int) -> torch.Tensor:
        import torch

        return self.view(offset, (1,), torch.int64)

    def read_word(self, offset: int) -> int:
        """Synchronous read of one int64 header word (diagnostics and error paths)."""
        return int(self.word(offset).item())

    def kv_layer(self, layer: int) -> torch.Tensor:
        return self.view(
            self._layout.kv_layer_offset(layer), self._layout.kv_layer_shape, self._dtype
        )

    def q_staging(self) -> torch.Tensor:
        return self.view(self._layout.q_offset, self._layout.staging_shape, self._dtype)

    def out_staging(self) -> torch.Tensor:
        return self.view(self._layout.out_offset, self._layout.staging_shape, self._dtype)

    def seq_lens(self) -> torch.Tensor:
        import torch

        return self.view(
            self._layout.seq_lens_offset, (self._layout.max_seqs_per_task,), torch.int32
        )

    def block_table(self) -> torch.Tensor:
        import torch

        lay = self._layout
        shape = (lay.max_seqs_per_task, lay.max_blocks_per_seq)
        return self.view(lay.block_table_offset, shape, torch.int32)

    @property
    def _dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self._layout.shape.dtype)


@dataclass(frozen=True)
class CudaTicket:
    seq: int
    layer: int
    num_seqs: int


class CudaOffloadSender:
    """Hot side: one task in flight; everything is enqueued on the current stream.

    wait() enqueues the spin kernel and returns the output view at once; read
    ``status()`` (a sync) before trusting the output, e.g. once per decode step.
    """

    def __init__(
        self,
        region: CudaRegion,
        library: KernelLibrary,
        *,
        timeout_s: float = 0.05,
        backoff_ns: int = 0,
    ) -> None:
        import torch

        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._region = region
        self._library = library
        self._timeout_s = timeout_s
        self._backoff_ns = backoff_ns
        self.device = torch.device("cuda", library.device_index)
        desc = region_descriptor(region.layout)
        self._desc = torch.tensor(desc, dtype=torch.int64, device=self.device)
        self._status = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._last_seq = region.read_word(TASK_SEQ_OFFSET)
        done = region.read_word(DONE_SEQ_OFFSET)
        if done != self._last_seq:
            raise ValueError(f"region {region.name!r} has task {self._last_seq} in flight")
        self._q, self._out = region.q_staging(), region.out_staging()
        self._seq_lens, self._block_table = region.seq_lens(), region.block_table()
        self._is_poisoned = False
        self._unwaited: CudaTicket | None = None

    @property
    def layout(self) -> RegionLayout:
        return self._region.layout

    def kv_layer(self, layer: int) -> torch.Tensor:
        return self._region.kv_layer(layer)

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
    ) -> CudaTicket:
        """Enqueue the copies and the publish. Block ids are checked by the cold kernel
        (a bad id makes the task FAILED) rather than here: checking needs a sync."""
        from weaver.offload.cuda import kernels

        if self._is_poisoned:
            raise ValueError("an earlier wait did not finish OK; call recover() first")
        if self._unwaited is not None:
            raise ValueError(f"task {self._unwaited.seq} was submitted but not waited for")
        if self._last_seq >= INT64_MAX:
            raise OverflowError("offload task sequence number would overflow int64")
        self._validate(layer, q, seq_lens, block_table)
        num_seqs, num_blocks = block_table.shape
        self._q[:num_seqs].copy_(q, non_blocking=True)
        self._seq_lens[:num_seqs].copy_(seq_lens, non_blocking=True)
        self._block_table[:num_seqs, :num_blocks].copy_(block_table, non_blocking=True)
        if num_blocks < self._block_table.shape[1]:
            # -1 makes a length past the given columns fail in the cold kernel instead of
            # reading a stale id of an earlier task
            self._block_table[:num_seqs, num_blocks:].fill_(-1)
        seq = self._last_seq + 1
        kernels.publish(
            self._library, self._region.tensor, self._desc, seq=seq, layer=layer,
            num_seqs=num_seqs, scale=scale, sliding_window=sliding_window, softcap=softcap,
            stamp=stamp,
        )  # fmt: skip
        self._last_seq = seq
        self._unwaited = CudaTicket(seq, layer, num_seqs)
        return self._unwaited

    def wait(
        self,
        ticket: CudaTicket,
        *,
        timeout_s: float | None = None,
        stamp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Enqueue the device-side wait; returns the output view (valid until next submit)."""
        from weaver.offload.cuda import kernels

        if self._unwaited is None or ticket.seq != self._unwaited.seq:
            raise ValueError(f"ticket {ticket.seq} is not the task in flight; wait once per submit")
        self._unwaited = None
        self._status.zero_()
        kernels.wait_done(
            self._library, self._region.tensor, self._desc, self._status, seq=ticket.seq,
            timeout_s=timeout_s or self._timeout_s, backoff_ns=self._backoff_ns, stamp=stamp,
        )  # fmt: skip
        return self._out[: ticket.num_seqs]

    def status(self) -> tuple[WaitStatus, int]:
        """(outcome, number of polls) of the last wait; synchronises the current stream, so
        call it on the stream that ran wait() (torch's side streams do not order with the
        default stream)."""
        outcome, num_polls = (int(x) for x in self._status.tolist())
        status = WaitStatus(outcome)
        if status != WaitStatus.OK:
            self._is_poisoned = True
        return status, num_polls

    def recover(self) -> bool:
        """After a failed wait: True (and submits allowed again) once the cold side caught up."""
        import torch

        torch.cuda.current_stream(self.device).synchronize()
        if self._region.read_word(DONE_SEQ_OFFSET) >= self._last_seq:
            self._is_poisoned = False
        return not self._is_poisoned

    def _validate(
        self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
    ) -> None:
        import torch

        lay = self._region.layout
        s = lay.shape
        if not 0 <= layer < s.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {s.num_layers})")
        if q.dim() != 3 or tuple(q.shape[1:]) != (s.num_q_heads, s.head_size):
            raise ValueError(
                f"q must be [num_seqs, {s.num_q_heads}, {s.head_size}], got {tuple(q.shape)}"
            )
        if q.dtype != self._q.dtype:
            raise ValueError(f"q dtype {q.dtype} != region dtype {s.dtype}; cast it first")
        num_seqs = q.shape[0]
        if not 1 <= num_seqs <= lay.max_seqs_per_task:
            raise ValueError(f"num_seqs {num_seqs} outside [1, {lay.max_seqs_per_task}]")
        if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
            raise ValueError(f"seq_lens must be int32 [{num_seqs}]")
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError("block_table must be int32 [num_seqs, n]")
        if block_table.shape[0] != num_seqs or block_table.shape[1] > lay.max_blocks_per_seq:
            raise ValueError(
                f"block_table must be [{num_seqs}, n <= {lay.max_blocks_per_seq}], got "
                f"{tuple(block_table.shape)}"
            )


class CudaOffloadReceiver:
    """Cold side: owns the region, serves tasks with the polling kernel.

    num_blocks: blocks of each poll launch (default: one per SM). Tasks are served by
    whichever launch sees them; idle launches cost one load per block.
    """

    def __init__(
        self, region: CudaRegion, library: KernelLibrary, *, num_blocks: int | None = None
    ):
        import torch

        if not region.is_owner:
            raise ValueError("CudaOffloadReceiver needs the region's owner (CudaRegion.create)")
        self._region = region
        self._library = library
        self.device = region.tensor.device
        props = torch.cuda.get_device_properties(self.device)
        self.num_blocks = num_blocks or props.multi_processor_count
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self._desc = torch.tensor(
            region_descriptor(region.layout), dtype=torch.int64, device=self.device
        )
        self._scratch = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._stop_flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._dtype = getattr(torch, region.layout.shape.dtype)
        self._head_size = region.layout.shape.head_size
        region.word(OWNER_PID_OFFSET).fill_(os.getpid())
        region.word(STATUS_OFFSET).fill_(int(RegionStatus.ALIVE))
        torch.cuda.synchronize(self.device)

    @property
    def layout(self) -> RegionLayout:
        return self._region.layout

    def kv_layer(self, layer: int) -> torch.Tensor:
        return self._region.kv_layer(layer)

    def poll(self, num_blocks: int | None = None) -> None:
        """Enqueue one poll on the current stream (after a cold operator)."""
        from weaver.offload.cuda import kernels

        kernels.poll_and_attend(
            self._library, self._dtype, self._region.tensor, self._desc, self._scratch,
            self._stop_flag, head_size=self._head_size, num_blocks=num_blocks or self.num_blocks,
        )  # fmt: skip

    def spin(self, max_spin_s: float, *, num_blocks: int | None = None) -> None:
        """Enqueue a persistent server that runs until request_stop() or max_spin_s."""
        from weaver.offload.cuda import kernels

        if max_spin_s <= 0:
            raise ValueError(f"max_spin_s must be > 0, got {max_spin_s}")
        kernels.poll_and_attend(
            self._library, self._dtype, self._region.tensor, self._desc, self._scratch,
            self._stop_flag, head_size=self._head_size, num_blocks=num_blocks or self.num_blocks,
            max_spin_s=max_spin_s,
        )  # fmt: skip

    def request_stop(self, stream: torch.cuda.Stream) -> None:
        """Ask running spin() kernels to return; enqueued on `stream` (not the spinning one)."""
        import torch

        with torch.cuda.stream(stream):
            self._stop_flag.fill_(1)

    def clear_stop(self) -> None:
        self._stop_flag.zero_()

    def num_served(self) -> int:
        """Tasks completed so far (synchronises)."""
        return int(self._scratch[3].item())

    def has_pending(self) -> bool:
        """Synchronous check of the counters (diagnostics)."""
        return self._region.read_word(TASK_SEQ_OFFSET) > self._region.read_word(DONE_SEQ_OFFSET)

    def close(self) -> None:
        """Mark the region CLOSED (hot waits end with CLOSED) and drop it."""
        import torch

        if self._region.is_closed:
            return
        self._region.word(STATUS_OFFSET).fill_(int(RegionStatus.CLOSED))
        torch.cuda.synchronize(self.device)
        self._region.close()
