"""The small interface a transport gives the offload protocol (channel.py).

A transport provides the region's bytes and two wakeups; the protocol (header words,
counters, staging, ordering) is written once in channel.py over any transport that fits.
The CPU transport is POSIX shared memory (shm_transport.py). A CUDA transport would
expose the same header through host-mapped memory, or replace the wakeups with device
spin kernels behind the same methods (architecture.md part 4).
"""

from __future__ import annotations

from typing import Protocol

import torch

from weaver.offload.layout import RegionLayout


class Wakeup(Protocol):
    """A one-directional doorbell: notify() never blocks; wait() sleeps without spinning."""

    def notify(self) -> None: ...

    def wait(self, timeout_s: float) -> bool:
        """Sleep until notified or timeout_s passes; True if a notification was consumed."""
        ...

    def close(self) -> None: ...


class RegionTransport(Protocol):
    """One mapped region plus the hot->cold (task) and cold->hot (done) doorbells."""

    @property
    def name(self) -> str: ...

    @property
    def is_owner(self) -> bool: ...

    @property
    def layout(self) -> RegionLayout: ...

    def words(self, offset: int, count: int, fmt: str = "q") -> memoryview:
        """Host-visible 8-byte words at a byte offset: "q" int64 (counters, status,
        metadata) or "d" float64. A memoryview item load/store is one aligned 8-byte
        access and about 3x cheaper than a numpy scalar, which matters at poll points."""
        ...

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view (no copy) of the region at a byte offset: staging, KV pool."""
        ...

    @property
    def task_wakeup(self) -> Wakeup: ...

    @property
    def done_wakeup(self) -> Wakeup: ...

    def close(self) -> None:
        """Unmap; the owner also removes the region's names. Safe to call twice."""
        ...
