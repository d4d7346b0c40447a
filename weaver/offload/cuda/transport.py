"""CUDA transport: the region in cold-device memory, its counters moved by kernels.

Same protocol and byte layout as the CPU transport (protocol.py, layout.py) behind the
same methods; what changes is who moves the counters:
  hot  ``publish``: ``weaver_publish`` writes the metadata and release-stores task_seq, on
       the hot stream after the staging copies (OffloadSender enqueues them first);
       ``wait_done`` enqueues ``weaver_wait_done``, a one-thread spin kernel with a timeout,
       so the hot stream's next kernel (o_proj) starts when the output is there and the CPU
       never blocks; ``wait_status`` reads its outcome after a synchronisation.
  cold ``arm``: the armed server (armed_server.py) serves tasks from a high-priority
       stream, concurrently with the cold model's kernels; a poll point (``serve``) on an
       armed region does nothing. Unarmed, ``serve`` enqueues ``weaver_poll_and_attend``
       after each cold operator (returns at once when task_seq == done_seq); ``spin``
       keeps it polling as a persistent server.

The region is one flat uint8 tensor allocated with torch on the cold device, exported
once with CUDA IPC (ipc.py) and opened once by the hot side; it never comes from vLLM's
KV pool. Host reads of its words synchronise, so the protocol's hot path never reads them:
``is_peer_open`` and ``may_have_task`` answer True, and the device wait reports CLOSED.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weaver.offload.cuda.region_desc import check_kernel_shape, region_descriptor
from weaver.offload.layout import (
    DONE_SEQ_OFFSET,
    HEADER_BYTES,
    REGION_MAGIC,
    TASK_SEQ_OFFSET,
    RegionLayout,
    TaskResult,
)
from weaver.offload.protocol import RegionBase, TaskMeta, WaitPolicy, WaitStatus

if TYPE_CHECKING:
    import torch

    from weaver.offload.cuda.armed_server import ArmedServer, ArmedServerConfig
    from weaver.offload.cuda.jit import KernelLibrary

logger = logging.getLogger(__name__)

# An idle cold engine's host-launched polls: one poll kernel per interval (it returns at
# once when nothing is pending), no synchronising read; the round trip to an idle cold GPU
# is then at most about this plus a launch. The GPU measurement compares it with a
# persistent spin() server (benchmarks/GPU_RUNBOOK.md).
IDLE_POLL_INTERVAL_S = 100e-6


@dataclass(frozen=True)
class CudaPollingExecutor:
    """The cold side's executor on CUDA: the polling kernel serves a task on the device
    with its own paged-attention code (csrc/offload_cold.cu). num_blocks: blocks of each
    poll launch (None: one per SM); idle launches cost one load per block."""

    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


class CudaRegion(RegionBase):
    """One offload region in device memory (implements protocol.Transport). Create on the
    cold side, attach on the hot; `library` loads the kernels on the device that launches
    them (the hot device for publish/wait, the cold device for serving)."""

    def __init__(self, layout: RegionLayout, name: str, tensor: torch.Tensor, is_owner: bool,
                 library: KernelLibrary) -> None:
        import torch

        super().__init__(layout, name, is_owner)
        self._tensor: torch.Tensor | None = tensor
        self._library = library
        self.device = torch.device("cuda", library.device_index)
        self._desc = torch.tensor(region_descriptor(layout), dtype=torch.int64,
                                  device=self.device)
        self._wait_status = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._dtype = getattr(torch, layout.shape.dtype)
        # The cold side's serving state: claim counters (csrc/offload_cold.cu ScratchIndex)
        # and the flag that stops a spinning server or a watch.
        from weaver.offload.cuda.kernels import SCRATCH_WORDS

        self._scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64, device=self.device)
        self._armed: ArmedServer | None = None
        self._stop_flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        # The hot side's fallbacks since the last take_num_fallbacks(), counted on the
        # device by the _if_failed attention (no host synchronisation per layer).
        self._num_fallbacks = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Where a fallback writes: not the output staging, which a cold side that is late
        # rather than gone may still write to while the hot side reads it.
        self._fallback_out = torch.zeros(layout.staging_shape, dtype=self._dtype,
                                         device=self.device)
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    @classmethod
    def create(cls, layout: RegionLayout, name: str, device: torch.device | str,
               library: KernelLibrary) -> CudaRegion:
        import torch

        check_kernel_shape(layout)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a CudaRegion lives on a CUDA device, got {device}")
        # Zeroed: the counters start at 0 and an untouched pool reads as zeros.
        tensor = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        header = bytearray(layout.initial_header(os.getpid()))
        tensor[:HEADER_BYTES].copy_(torch.frombuffer(header, dtype=torch.uint8))
        torch.cuda.synchronize(device)  # complete before the handle is exported
        logger.info(
            "created CUDA offload region %s (%d bytes on %s)", name, layout.total_bytes, device
        )
        return cls(layout, name, tensor, True, library)

    @classmethod
    def attach(cls, layout: RegionLayout, name: str, handle: bytes,
               library: KernelLibrary) -> CudaRegion:
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
        return cls(layout, name, tensor, False, library)

    def load_kernels(self) -> None:
        """Load (compiling at most once per machine, cached on disk) the kernels this side
        launches, so that no request waits for a compiler: publish, wait and fallback on
        the hot side, the poll on the cold side."""
        from weaver.offload.cuda import kernels

        head_size = self._layout.shape.head_size
        if self._is_owner:
            names = [(kernels.COLD_FILE, kernels.kernel_name("weaver_poll_and_attend",
                                                             self._dtype, head_size))]
        else:
            names = [(kernels.HOT_FILE, "weaver_publish"), (kernels.HOT_FILE, "weaver_wait_done"),
                     (kernels.ATTENTION_FILE, kernels.kernel_name(
                         "weaver_paged_attention_if_failed", self._dtype, head_size))]
        for file_name, kernel in names:
            self._library.function(file_name, kernel)

    def export_handle(self) -> bytes:
        """Bytes for the hot side's attach(); only the owner exports."""
        from weaver.offload.cuda.ipc import export_tensor

        if not self._is_owner:
            raise ValueError("only the region's owner (the cold side) exports its handle")
        return export_tensor(self.region_tensor)

    # --- memory ---------------------------------------------------------------------
    @property
    def region_tensor(self) -> torch.Tensor:
        """The region's bytes: a flat uint8 tensor on the cold device."""
        if self._tensor is None:
            raise ValueError(f"CUDA offload region {self._name!r} is closed")
        return self._tensor

    @property
    def is_closed(self) -> bool:
        return self._tensor is None

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import math

        num_bytes = math.prod(shape) * dtype.itemsize
        self._check_range(offset, num_bytes)
        return self.region_tensor[offset : offset + num_bytes].view(dtype).view(shape)

    def _word(self, offset: int, fmt: str) -> torch.Tensor:
        import torch

        self._check_word(offset, fmt)
        return self.tensor(offset, (1,), torch.int64 if fmt == "q" else torch.float64)

    def read_word(self, offset: int, fmt: str = "q") -> int | float:
        """A synchronising read: after everything this process enqueued on its current
        stream (a device wait included)."""
        import torch

        torch.cuda.current_stream(self.device).synchronize()
        return self._word(offset, fmt).item()

    def write_word(self, offset: int, value: int | float, fmt: str = "q") -> None:
        import torch

        self._word(offset, fmt).fill_(value)
        torch.cuda.synchronize(self.region_tensor.device)

    # --- hot side -------------------------------------------------------------------
    def publish(self, seq: int, meta: TaskMeta, stamp: torch.Tensor | None = None) -> None:
        from weaver.offload.cuda import kernels

        kernels.publish(
            self._library, self.region_tensor, self._desc, seq=seq, layer=meta.layer,
            num_seqs=meta.num_seqs, scale=meta.scale, sliding_window=meta.sliding_window,
            softcap=meta.softcap, stamp=stamp,
        )  # fmt: skip

    def wait_done(self, seq: int, timeout_s: float, policy: WaitPolicy,
                  stamp: torch.Tensor | None = None) -> tuple[WaitStatus, int]:
        from weaver.offload.cuda import kernels

        self._wait_status.zero_()
        kernels.wait_done(
            self._library, self.region_tensor, self._desc, self._wait_status, seq=seq,
            timeout_s=timeout_s, backoff_ns=policy.backoff_ns, stamp=stamp,
        )  # fmt: skip
        return WaitStatus.PENDING, 0

    def wait_status(self) -> tuple[WaitStatus, int]:
        """(outcome, number of polls) of the last wait; synchronises the current stream, so
        call it on the stream that ran the wait (torch's side streams do not order with the
        default stream)."""
        outcome, num_polls = (int(x) for x in self._wait_status.tolist())
        return WaitStatus(outcome), num_polls

    def is_peer_open(self) -> bool:
        return True  # not without a synchronisation: the device wait reports CLOSED

    def enqueue_fallback(self, meta: TaskMeta) -> torch.Tensor:
        """After wait_done, on the same stream: if that wait did not end OK, attend the
        task (still in the staging area) here, over the region's KV, and count it. Returns
        the task's output on this device, in stream order: the cold side's when the wait
        ended OK, the fallback's otherwise, chosen on the device (no host synchronisation;
        take_num_fallbacks() tells the host later)."""
        import torch

        from weaver.offload.cuda import kernels

        lay = self._layout
        _, num_heads, head_size = lay.staging_shape
        n = meta.num_seqs
        kernels.paged_decode_attention_if_failed(
            self._library,
            self.tensor(lay.q_offset, (n, num_heads, head_size), self._dtype),
            self.tensor(lay.kv_layer_offset(meta.layer), lay.kv_layer_shape, self._dtype),
            self.tensor(lay.seq_lens_offset, (n,), torch.int32),
            self.tensor(lay.block_table_offset, (lay.max_seqs_per_task, lay.max_blocks_per_seq),
                        torch.int32)[:n],
            self._fallback_out[:n],
            meta.scale, wait_status=self._wait_status, num_fallbacks=self._num_fallbacks,
            sliding_window=meta.sliding_window, softcap=meta.softcap,
            kv_format=lay.shape.kv_format,
        )  # fmt: skip
        served = self.tensor(lay.out_offset, (n, num_heads, head_size), self._dtype)
        is_ok = self._wait_status[0] == int(WaitStatus.OK)
        return torch.where(is_ok, served.to(self.device, non_blocking=True),
                           self._fallback_out[:n])

    def take_num_fallbacks(self) -> int:
        """Fallbacks the device ran since the last call (synchronises the current stream:
        once per step, not per layer)."""
        count = int(self._num_fallbacks.item())
        if count:
            self._num_fallbacks.zero_()
        return count

    # --- cold side ------------------------------------------------------------------
    def has_pending(self) -> bool:
        """Synchronous check of the counters (diagnostics, the host idle loop)."""
        return self.read_word(TASK_SEQ_OFFSET) > self.read_word(DONE_SEQ_OFFSET)

    def may_have_task(self) -> bool:
        """Whether the host has a task to serve: never while the armed server serves the
        region; else True (the polling kernel returns at once when nothing is pending)."""
        return self._armed is None

    def serve(self, executor: object, on_served: Callable[[TaskResult], None]) -> bool:
        """Enqueue one poll on the current stream (after a cold operator); the kernel serves
        a pending task on the device, so on_served is not called (num_served counts)."""
        if not isinstance(executor, CudaPollingExecutor):
            raise TypeError(f"the CUDA transport serves tasks on the device; its executor is "
                            f"a CudaPollingExecutor, not {type(executor).__name__}")
        if self._armed is None:
            self.poll(executor.num_blocks)
        return False

    def poll(self, num_blocks: int | None = None) -> None:
        """Enqueue one poll of num_blocks blocks (None: one per SM) on the current stream."""
        self._launch_poll(num_blocks, max_spin_s=0.0)

    def spin(self, max_spin_s: float, *, num_blocks: int | None = None) -> None:
        """Enqueue a persistent server that runs until request_stop() or max_spin_s."""
        if max_spin_s <= 0:
            raise ValueError(f"max_spin_s must be > 0, got {max_spin_s}")
        self._launch_poll(num_blocks, max_spin_s=max_spin_s)

    def arm(self, config: ArmedServerConfig | None = None) -> ArmedServer:
        """Serve this (owned) region with an armed server from now on; poll points do
        nothing while it runs (one server per region: two would split one task's claims)."""
        from weaver.offload.cuda.armed_server import ArmedServer

        if not self._is_owner:
            raise ValueError("only the region's owner (the cold side) serves its tasks")
        if self._armed is None:
            self._armed = ArmedServer(self, config)
            self._armed.start()
        return self._armed

    def disarm(self) -> None:
        """Stop the armed server (a task already published is still served)."""
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.stop()

    @property
    def armed_server(self) -> ArmedServer | None:
        return self._armed

    def _launch_poll(self, num_blocks: int | None, *, max_spin_s: float) -> None:
        from weaver.offload.cuda import kernels

        if self._armed is not None:
            raise ValueError(f"region {self._name!r} is served by its armed server; disarm() "
                             "it before launching poll kernels")
        kernels.poll_and_attend(
            self._library, self._dtype, self.region_tensor, self._desc, self._scratch,
            self._stop_flag, head_size=self._layout.shape.head_size,
            num_blocks=num_blocks or self._num_sms, max_spin_s=max_spin_s,
        )  # fmt: skip

    def request_stop(self, stream: torch.cuda.Stream) -> None:
        """Ask running spin() kernels to return; enqueued on `stream` (not the spinning one)."""
        import torch

        with torch.cuda.stream(stream):
            self._stop_flag.fill_(1)

    def clear_stop(self) -> None:
        self._stop_flag.zero_()

    def num_served(self) -> int:
        """Tasks the device has completed so far (synchronises)."""
        return int(self._scratch[3].item())

    def wait_for_task(self, timeout_s: float) -> bool:
        """Host-launched polls for an idle cold engine: sleep one IDLE_POLL_INTERVAL_S (or
        timeout_s if shorter) and answer True, so the idle poller enqueues a poll kernel,
        which serves a pending task or returns at once. Reading the counters instead would
        synchronise the cold model's stream every interval. An armed region serves
        itself: sleep the whole timeout and answer False (its idle poller then only
        stamps the heartbeat)."""
        if self._armed is not None:
            time.sleep(timeout_s)
            return False
        time.sleep(min(timeout_s, IDLE_POLL_INTERVAL_S))
        return True

    def wake_waiters(self) -> None:
        """Nothing sleeps on a doorbell here: device waits see the status word, and a host
        wait_for_task ends within its timeout."""

    def close(self) -> None:
        """Stop the armed server, then drop this process's reference (the owner frees the
        memory once no view is left)."""
        try:
            self.disarm()
        finally:
            self._tensor = None
