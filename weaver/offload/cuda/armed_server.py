"""The cold side's armed server on CUDA: watch + attend kernel pairs kept queued on a
high-priority stream (csrc/offload_cold.cu, weaver_watch and weaver_attend_armed).

Why this and not a poll kernel after every cold operator (the first design): measured on
an H200 against a Llama-3-8B-shaped cold step (benchmarks/results/gpu_h200/), the poll
after every operator cost 1.97 % of an idle cold step (161 launches) and left 16 of 1,000
busy tasks served by the one block that read the counters after the publish (6.8 ms
waits); an armed watcher cost 0.19 % of the step, and with whole items its busy p99 was
221 us. The watch is one thread with a bounded spin (``watch_s``), so a cold process's own
synchronisation never waits longer than that for it; the attend after it serves exactly
the seq the watch saw, with its whole grid.

One host thread per server keeps ``queued_pairs`` pairs on the stream: it wakes every
``refill_s``, drops the pairs that ended, and queues new ones. A pair whose watch saw no
task costs one launch of an attend kernel that returns at once. If the host thread falls
behind (the queue found empty), tasks wait for the next refill: counted as underruns.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weaver.offload.cuda.transport import CudaRegion

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArmedServerConfig:
    """How the armed server runs (the defaults are what the H200 run measured)."""

    num_blocks: int | None = None  # attend grid; None: one block per SM
    span_tokens: int = 64  # context span of one unit when a task is split (one iteration)
    queued_pairs: int = 4  # (watch, attend) pairs kept on the stream
    watch_s: float = 0.002  # longest spin of one watch (a device-wide sync waits <= 4 x this)
    refill_s: float = 0.0005  # host thread's period
    backoff_ns: int = 64  # sleep between two reads of the counters by the watch

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.span_tokens < 1 or self.queued_pairs < 1:
            raise ValueError("span_tokens and queued_pairs must be >= 1")
        if self.watch_s <= 0 or self.refill_s <= 0 or self.backoff_ns < 0:
            raise ValueError("watch_s and refill_s must be > 0, backoff_ns >= 0")


class ArmedServer:
    """Serves one CudaRegion (owned by the cold side) from a high-priority stream."""

    def __init__(self, region: CudaRegion, config: ArmedServerConfig | None = None) -> None:
        import torch

        from weaver.offload.cuda import kernels

        self.region = region
        self.config = config or ArmedServerConfig()
        device = region.device
        self.num_blocks = self.config.num_blocks or torch.cuda.get_device_properties(
            device).multi_processor_count
        head_size = region.layout.shape.head_size
        # Spans only split tasks of fewer items than blocks, so at most one unit per block
        # holds a partial state.
        self._partial = torch.zeros(self.num_blocks * kernels.partial_floats(head_size),
                                    dtype=torch.float32, device=device)
        self._span_count = torch.zeros(self.num_blocks, dtype=torch.int32, device=device)
        priority_range = torch.cuda.Stream.priority_range()
        self.stream = torch.cuda.Stream(device=device, priority=priority_range[1])
        self._control = torch.cuda.Stream(device=device)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_pairs = 0  # pairs that ended
        self.num_underruns = 0  # refills that found no pair queued
        self.error: BaseException | None = None

    def launch_pair(self) -> None:
        """One watch and one attend on the current stream (the server's, or a test's)."""
        from weaver.offload.cuda import kernels

        region, config = self.region, self.config
        kernels.watch(region._library, region.region_tensor, region._desc, region._scratch,
                      region._stop_flag, max_spin_s=config.watch_s, backoff_ns=config.backoff_ns)
        kernels.attend_armed(region._library, region._dtype, region.region_tensor, region._desc,
                             region._scratch, self._partial, self._span_count,
                             head_size=region.layout.shape.head_size,
                             num_blocks=self.num_blocks, span_tokens=config.span_tokens)

    def load_kernels(self) -> None:
        from weaver.offload.cuda import kernels

        library, dtype = self.region._library, self.region._dtype
        library.function(kernels.COLD_FILE, "weaver_watch")
        library.function(kernels.COLD_FILE, kernels.kernel_name(
            "weaver_attend_armed", dtype, self.region.layout.shape.head_size))

    @property
    def is_running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        import torch

        if self._thread is not None:
            return
        self.load_kernels()
        with torch.cuda.stream(self._control):
            self.region._stop_flag.zero_()
            # One pair now, waited for: with CUDA's lazy loading a kernel's module loads at
            # its first launch and may wait for the running kernels, which a queue of
            # spinning watches would keep from ever ending.
            self.launch_pair()
        self._control.synchronize()
        self._stop.clear()
        self._thread = threading.Thread(target=self._refill_loop, name="weaver-armed-server",
                                        daemon=True)
        self._thread.start()

    def _refill_loop(self) -> None:
        import torch

        try:
            torch.cuda.set_device(self.region.device)
            queued: deque[Any] = deque()
            while not self._stop.is_set():
                while queued and queued[0].query():
                    queued.popleft()
                    self.num_pairs += 1
                if not queued and self.num_pairs:
                    self.num_underruns += 1
                with torch.cuda.stream(self.stream):
                    while len(queued) < self.config.queued_pairs:
                        self.launch_pair()
                        event = torch.cuda.Event()
                        event.record(self.stream)
                        queued.append(event)
                self._stop.wait(self.config.refill_s)
        except BaseException as exc:  # kept for stop(), which raises it
            logger.exception("the armed server of region %s failed", self.region.name)
            self.error = exc

    def stop(self) -> None:
        """Stop refilling, end the queued watches (the stop flag), wait for the stream."""
        import torch

        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None
        if not self.region.is_closed:
            with torch.cuda.stream(self._control):
                self.region._stop_flag.fill_(1)
            # every queued watch now returns at its next read; each attend serves what its
            # watch armed (a task already published is still served)
            self.stream.synchronize()
            with torch.cuda.stream(self._control):
                self.region._stop_flag.zero_()
            self._control.synchronize()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the armed server of {self.region.name} failed") from error
