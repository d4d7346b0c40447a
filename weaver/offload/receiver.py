"""The cold side of one offload region: serve tasks at poll points (protocol.py), over any
transport. Between the cold model's steps its regions are served by one idle poller over
all of them, ColdWeaving's (weaver/weaving/cold.py), which calls `poll(by_idle_poller=True)`.

A poll point runs between the cold model's own operators, so its idle case must cost
next to nothing: one int64 compare on CPU, one kernel that returns at once on CUDA.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from weaver.offload.layout import (
    HEARTBEAT_OFFSET,
    OWNER_PID_OFFSET,
    STATUS_OFFSET,
    RegionLayout,
    RegionStatus,
    TaskResult,
)
from weaver.offload.protocol import RegionViews, Transport

logger = logging.getLogger(__name__)


@dataclass
class ReceiverStats:
    num_served: int = 0
    num_failed: int = 0
    num_served_at_poll_points: int = 0
    num_served_by_idle_poller: int = 0
    total_busy_s: float = 0.0
    # Split by where the task was served: at poll points the time lands inside one of
    # the cold model's own steps (what its TPOT pays); by the idle poller it does not.
    busy_at_poll_points_s: float = 0.0
    busy_by_idle_poller_s: float = 0.0


class OffloadReceiver:
    """Cold side of one region: the owner of the region's lifecycle (status words), the
    lock that keeps one task served at a time, and the counters of what it served.

    executor: what serves a task: a host callable writing task.out (CPU; e.g. the vLLM
    CPU kernel executor) or a device executor (CUDA); if it has a release() method,
    close() calls it before the region is unmapped.
    """

    def __init__(self, transport: Transport, executor: object) -> None:
        if not transport.is_owner:
            raise ValueError("OffloadReceiver needs the region's owner (the transport that "
                             "created the region)")
        self._transport = transport
        self._layout = transport.layout
        self._executor = executor
        self._views: RegionViews | None = RegionViews.over(transport)
        # One lock: a poll point (model thread) only tries it; close() waits for it.
        self._lock = threading.Lock()
        self.stats = ReceiverStats()
        transport.write_word(OWNER_PID_OFFSET, os.getpid())
        transport.write_word(HEARTBEAT_OFFSET, time.monotonic(), "d")
        transport.write_word(STATUS_OFFSET, int(RegionStatus.ALIVE))

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    @property
    def transport(self) -> Transport:
        return self._transport

    def kv_layer(self, layer: int) -> torch.Tensor:
        self._layout.kv_layer_offset(layer)
        if self._views is None:
            raise ValueError("this OffloadReceiver is closed")
        return self._views.kv_layers[layer]

    def has_pending(self) -> bool:
        return self._transport.has_pending()

    def wait_for_task(self, timeout_s: float) -> bool:
        """Sleep on the region's doorbell until a task may be pending (an idle loop of the
        caller's own, e.g. one that serves several regions under a step lock)."""
        return self._transport.wait_for_task(timeout_s)

    def poll(self, *, by_idle_poller: bool = False) -> bool:
        """Serve a pending task now if no other thread is serving; True if one was served
        (on the host: a device transport's kernel serves without telling the host).

        Called between every cold operator. by_idle_poller: the caller is the idle poller
        (which also takes the engine's step lock), not a poll point; it only changes the
        stats.
        """
        if self._views is None or not self._transport.may_have_task():
            return False  # closed, or nothing pending
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._serve_locked(by_idle_poller=by_idle_poller)
        finally:
            self._lock.release()

    def heartbeat(self) -> None:
        """Stamp the region's heartbeat word (the idle poller does, every pass)."""
        if self._views is not None:
            self._transport.write_word(HEARTBEAT_OFFSET, time.monotonic(), "d")

    def close(self) -> None:
        """Tell the hot side we are going (its waits fail fast), remove the region. The idle
        poller serving it must have left it (ColdWeaving.remove and close see to that)."""
        if self._views is None:
            return
        self._transport.write_word(STATUS_OFFSET, int(RegionStatus.CLOSING))
        self._transport.wake_waiters()
        release = getattr(self._executor, "release", None)
        with self._lock:
            if release is not None:
                release()  # an executor may keep views of the region between tasks
            self._transport.write_word(STATUS_OFFSET, int(RegionStatus.CLOSED))
            self._transport.wake_waiters()
            self._views = None  # drop the views before unmapping
        self._transport.close()

    # --- internals ----------------------------------------------------------------
    def _serve_locked(self, *, by_idle_poller: bool) -> bool:
        start = time.monotonic()

        def count(result: TaskResult) -> None:
            # Called before the completion is published, so a hot side that sees the
            # completion also sees the task counted.
            busy_s = time.monotonic() - start
            stats = self.stats
            stats.num_served += 1
            stats.num_failed += result is TaskResult.FAILED
            if by_idle_poller:
                stats.num_served_by_idle_poller += 1
                stats.busy_by_idle_poller_s += busy_s
            else:
                stats.num_served_at_poll_points += 1
                stats.busy_at_poll_points_s += busy_s
            stats.total_busy_s += busy_s

        return self._transport.serve(self._executor, count)
