"""CPU transport: the region lives in POSIX shared memory, the host moves the counters,
the doorbells are named FIFOs (protocol.py).

The cold side creates and owns the region (``ShmRegion.create``); the hot side attaches
(``ShmRegion.attach``). Only the owner removes the names, on ``close()`` or at exit.

Why not ``multiprocessing.shared_memory``: before Python 3.13 every process that
*attaches* a SharedMemory registers it with its resource_tracker, which unlinks the
segment when that process exits (CPython gh-82300), so a hot engine's restart would
delete the cold engine's region. Opening the file under /dev/shm (what shm_open does on
Linux) with os.open + mmap keeps ownership explicit and the tracker out of it.

Why FIFOs: the cold side's idle poller and the hot side's waits must sleep, not spin, on
a 2-core machine. A FIFO opened O_RDWR|O_NONBLOCK never blocks on open or write and works
with select(); a byte written after a counter is published wakes the sleeper.

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

import atexit
import contextlib
import logging
import mmap
import os
import select
import stat
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from weaver.offload.layout import (
    DONE_RESULT_OFFSET,
    DONE_SEQ_OFFSET,
    HEADER_BYTES,
    META_LAYER,
    META_NUM_FLOAT_WORDS,
    META_NUM_INT_WORDS,
    META_NUM_SEQS,
    META_SCALE,
    META_SLIDING_WINDOW,
    META_SOFTCAP,
    META_TASK_SEQ,
    OPEN_STATUSES,
    OWNER_PID_OFFSET,
    REGION_MAGIC,
    STATUS_OFFSET,
    TASK_SEQ_OFFSET,
    RegionLayout,
    TaskResult,
)
from weaver.offload.naming import (
    DEFAULT_SHM_DIR,
    DONE_FIFO_SUFFIX,
    TASK_FIFO_SUFFIX,
    region_name,
    region_paths,
    validate_region_name,
)
from weaver.offload.protocol import (
    OffloadError,
    OffloadTask,
    RegionBase,
    RegionViews,
    TaskMeta,
    WaitPolicy,
    WaitStatus,
    check_task_bounds,
)
from weaver.processes import is_process_alive

if TYPE_CHECKING:  # torch only where tensors are made: creating and attaching stay light
    import torch

logger = logging.getLogger(__name__)

# How long the hot side spins on a completion before sleeping on the doorbell, by whether
# it shares a core with the cold side (host_wait_policy).
OWN_CORE_SPIN_S = 2e-3
SHARED_CORE_SPIN_S = 50e-6


class FifoWakeup:
    """Doorbell over a named FIFO; see the module docstring for why O_RDWR|O_NONBLOCK."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def notify(self) -> None:
        # try/except rather than contextlib.suppress: this runs once per task.
        try:  # noqa: SIM105
            os.write(self._fd, b"\x01")
        except BlockingIOError:
            pass  # pipe full: the sleeper is already signalled

    def wait(self, timeout_s: float) -> bool:
        """Sleep until notified or timeout_s passes; True if a notification was consumed."""
        readable, _, _ = select.select([self._fd], [], [], max(timeout_s, 0.0))
        if not readable:
            return False
        self._drain()
        return True

    def _drain(self) -> None:
        # Drain every pending byte: the caller re-reads the counters after waking, so
        # coalescing several notifications into one wakeup loses nothing.
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 4096):
                pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmRegion(RegionBase):
    """A mapped offload region in shared memory (implements protocol.Transport)."""

    def __init__(self, layout: RegionLayout, name: str, path: str, fd: int,
                 is_owner: bool) -> None:
        super().__init__(layout, name, is_owner)
        self._path = path
        self._mmap = mmap.mmap(fd, layout.total_bytes)
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self._buffer = memoryview(self._mmap)
        self._task_wakeup = FifoWakeup(path + TASK_FIFO_SUFFIX)
        self._done_wakeup = FifoWakeup(path + DONE_FIFO_SUFFIX)
        self._is_closed = False
        # The words the protocol reads and writes on every task, cast once: a memoryview
        # item load/store is one aligned 8-byte access and about 3x cheaper than a numpy
        # scalar, which matters at poll points.
        self._task_seq = self.words(TASK_SEQ_OFFSET, 1)
        self._done_seq_word = self.words(DONE_SEQ_OFFSET, 1)
        self._done_result = self.words(DONE_RESULT_OFFSET, 1)
        self._status = self.words(STATUS_OFFSET, 1)
        self._meta_ints = self.words(layout.meta_offset, META_NUM_INT_WORDS)
        self._meta_floats = self.words(layout.meta_floats_offset, META_NUM_FLOAT_WORDS, "d")
        self._views: RegionViews | None = None  # the owner's, for serving tasks
        self._done_seq = int(self._done_seq_word[0])  # the owner's last completion
        # The bytes of the last staged batch (seq_lens, block table) that passed the bounds
        # check: the layers of one hot step send the same batch, checked once here too.
        self._checked_batch: bytes | None = None
        self._last_wait: tuple[WaitStatus, int] = (WaitStatus.PENDING, 0)
        if is_owner:
            atexit.register(self.close)

    # --- construction -------------------------------------------------------------
    @classmethod
    def create(cls, layout: RegionLayout, name: str, shm_dir: str = DEFAULT_SHM_DIR) -> ShmRegion:
        """Create and own the region (cold side). A stale region of a dead owner is reclaimed."""
        validate_region_name(name)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shared-memory directory {shm_dir!r} does not exist; pass shm_dir")
        path = os.path.join(shm_dir, name)
        _reclaim_if_stale(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # tmpfs pages are zero and materialise on first touch, so an untouched
            # KV pool costs no memory yet.
            os.ftruncate(fd, layout.total_bytes)
            for suffix in (TASK_FIFO_SUFFIX, DONE_FIFO_SUFFIX):
                os.mkfifo(path + suffix, 0o600)
            region = cls(layout, name, path, fd, is_owner=True)
        except BaseException:
            _remove_names(path)
            raise
        buf = region.buffer
        # Magic goes last: an attacher that sees it sees a complete header.
        header = layout.initial_header(os.getpid())
        buf[len(REGION_MAGIC) : len(header)] = header[len(REGION_MAGIC) :]
        buf[: len(REGION_MAGIC)] = header[: len(REGION_MAGIC)]
        logger.info("created offload region %s (%d bytes)", path, layout.total_bytes)
        return region

    @classmethod
    def attach(
        cls,
        layout: RegionLayout,
        name: str,
        shm_dir: str = DEFAULT_SHM_DIR,
        wait_s: float = 0.0,
    ) -> ShmRegion:
        """Map a region the cold side created (hot side); never removes it.

        wait_s: how long to wait for the owner to create it (startup ordering).
        """
        validate_region_name(name)
        path = os.path.join(shm_dir, name)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls._attach_once(layout, name, path)
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"no offload region {path!r}: start the cold side first, or check that "
                        "both sides use the same region prefix and model names"
                    ) from None
            except _NotReady:
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"offload region {path!r} exists but its owner never finished "
                        "creating it; is the cold side stuck?"
                    ) from None
            time.sleep(0.01)

    @classmethod
    def _attach_once(cls, layout: RegionLayout, name: str, path: str) -> ShmRegion:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        with open(path, "rb") as f:
            head = f.read(len(REGION_MAGIC))
        if size == 0 or head == b"\0" * len(REGION_MAGIC):
            os.close(fd)
            raise _NotReady
        if size != layout.total_bytes:
            os.close(fd)
            with open(path, "rb") as f:
                layout.verify_header(f.read(4096))  # names the differing fields
            raise ValueError(
                f"offload region {path!r} has {size} bytes, this side expects "
                f"{layout.total_bytes}; configure both sides with the same layout"
            )
        region = cls(layout, name, path, fd, is_owner=False)
        try:
            layout.verify_header(region.buffer)
        except BaseException:
            region.close()
            raise
        return region

    # --- memory ---------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @property
    def buffer(self) -> memoryview:
        if self._is_closed:
            raise ValueError(f"offload region {self._name!r} is closed")
        return self._buffer

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def words(self, offset: int, count: int, fmt: str = "q") -> memoryview:
        """Host-visible 8-byte words at a byte offset: "q" int64 or "d" float64."""
        self._check_word(offset, fmt)
        self._check_range(offset, 8 * count)
        return self.buffer[offset : offset + 8 * count].cast(fmt)

    def read_word(self, offset: int, fmt: str = "q") -> int | float:
        return self.words(offset, 1, fmt)[0]

    def write_word(self, offset: int, value: int | float, fmt: str = "q") -> None:
        self.words(offset, 1, fmt)[0] = value

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        count = 1
        for dim in shape:
            count *= dim
        self._check_range(offset, count * dtype.itemsize)
        return torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset).view(shape)

    def shares_cores_with_owner(self) -> bool:
        """Whether this process may run on a core the owner (cold) process may run on;
        True when the owner is gone or not visible (assume the worst)."""
        owner_pid = int(self.read_word(OWNER_PID_OFFSET))
        try:
            return bool(os.sched_getaffinity(0) & os.sched_getaffinity(owner_pid))
        except OSError:
            return True

    # --- hot side -------------------------------------------------------------------
    def publish(self, seq: int, meta: TaskMeta, stamp: torch.Tensor | None = None) -> None:
        ints, floats = self._meta_ints, self._meta_floats
        ints[META_LAYER] = meta.layer
        ints[META_NUM_SEQS] = meta.num_seqs
        ints[META_SLIDING_WINDOW] = meta.sliding_window
        floats[META_SCALE] = meta.scale
        floats[META_SOFTCAP] = meta.softcap
        ints[META_TASK_SEQ] = seq
        self._task_seq[0] = seq  # publish: the LAST store (see the module docstring)
        self._task_wakeup.notify()
        if stamp is not None:
            stamp.fill_(time.monotonic_ns())

    def wait_done(self, seq: int, timeout_s: float, policy: WaitPolicy,
                  stamp: torch.Tensor | None = None) -> tuple[WaitStatus, int]:
        done_seq = self._done_seq_word
        start = time.monotonic()
        deadline = start + timeout_s
        spin_until = start + policy.spin_s
        num_sleeps = 0
        status = WaitStatus.PENDING
        while done_seq[0] < seq:
            now = time.monotonic()
            if now < spin_until:
                continue
            status = WaitStatus.TIMEOUT if now >= deadline else self._peer_gone()
            if status is not WaitStatus.PENDING:
                break
            self._done_wakeup.wait(min(deadline - now, policy.liveness_check_s))
            num_sleeps += 1
        if status is WaitStatus.PENDING:
            done = int(done_seq[0])
            if done != seq:
                status = WaitStatus.PROTOCOL_ERROR
            elif int(self._done_result[0]) != TaskResult.OK:
                status = WaitStatus.FAILED
            else:
                status = WaitStatus.OK
        if stamp is not None:
            stamp.fill_(time.monotonic_ns())
        self._last_wait = (status, num_sleeps)
        return self._last_wait

    def wait_status(self) -> tuple[WaitStatus, int]:
        return self._last_wait

    def enqueue_fallback(self, meta: TaskMeta) -> torch.Tensor:
        raise TypeError("a host wait ends with its outcome: the hot side falls back on the "
                        "host (weaving/hot.py), not on a device stream")

    def take_num_fallbacks(self) -> int:
        return 0  # host fallbacks are counted where they run (weaving/hot.py)

    def is_peer_open(self) -> bool:
        return int(self._status[0]) in OPEN_STATUSES

    def _peer_gone(self) -> WaitStatus:
        """CLOSED or DEAD when the cold side is gone, else PENDING."""
        if not self.is_peer_open():
            return WaitStatus.CLOSED
        if not is_process_alive(int(self.read_word(OWNER_PID_OFFSET))):
            return WaitStatus.DEAD
        return WaitStatus.PENDING

    # --- cold side ------------------------------------------------------------------
    def has_pending(self) -> bool:
        return int(self._task_seq[0]) > self._done_seq

    def may_have_task(self) -> bool:
        return self._task_seq[0] > self._done_seq

    def serve(self, executor: object, on_served: Callable[[TaskResult], None]) -> bool:
        seq = int(self._task_seq[0])  # acquire side: read the counter before the data
        if seq <= self._done_seq:
            return False
        result = TaskResult.OK
        try:
            if seq != self._done_seq + 1:
                raise OffloadError(f"task_seq jumped from {self._done_seq} to {seq}")
            executor(self._read_task(seq))  # type: ignore[operator]  # a host executor
        except Exception:
            logger.exception("offload task %d on %s failed", seq, self._name)
            result = TaskResult.FAILED
        on_served(result)
        self._done_result[0] = int(result)
        self._done_seq_word[0] = seq  # publish the completion: the LAST store
        self._done_seq = seq
        self._done_wakeup.notify()
        return True

    def _read_task(self, seq: int) -> OffloadTask:
        lay = self._layout
        ints, floats = self._meta_ints, self._meta_floats
        meta_seq = int(ints[META_TASK_SEQ])
        if meta_seq != seq:
            raise OffloadError(f"metadata belongs to task {meta_seq}, expected {seq}")
        layer = int(ints[META_LAYER])
        num_seqs = int(ints[META_NUM_SEQS])
        if not 0 <= layer < lay.shape.num_layers or not 1 <= num_seqs <= lay.max_seqs_per_task:
            raise OffloadError(f"task {seq}: bad layer {layer} or num_seqs {num_seqs}")
        if self._views is None:
            self._views = RegionViews.over(self)
        v = self._views
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
            scale=float(floats[META_SCALE]),
            sliding_window=int(ints[META_SLIDING_WINDOW]),
            softcap=float(floats[META_SOFTCAP]),
        )

    def wait_for_task(self, timeout_s: float) -> bool:
        return self._task_wakeup.wait(timeout_s)

    def wake_waiters(self) -> None:
        # A region closed already (its own atexit close runs before the worker's, which
        # stops the idle poller) has no doorbell left to ring, and no waiter on it.
        if self._is_closed:
            return
        self._task_wakeup.notify()
        self._done_wakeup.notify()

    # --- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._is_owner:
            _remove_names(self._path)
            atexit.unregister(self.close)
        self._task_wakeup.close()
        self._done_wakeup.close()
        # Drop our own casts and views first, or the buffer cannot be released.
        self._task_seq = self._done_seq_word = self._done_result = self._status = None  # type: ignore[assignment]
        self._meta_ints = self._meta_floats = None  # type: ignore[assignment]
        self._views = None
        try:
            self._buffer.release()
            self._mmap.close()
        except BufferError:
            # Tensors/arrays over the region are still alive somewhere; the mapping is
            # released when they are collected. The names are already gone.
            logger.debug("offload region %s: views still alive, unmapping deferred", self._name)

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_wait_policy(region: ShmRegion) -> WaitPolicy:
    """How the hot side waits on this region. While it waits, the hot worker has nothing
    else to run. When it has cores of its own (none shared with the cold worker), spinning
    a while saves a sleep/wake-up per layer and steals from no one; when they share a core,
    spinning would delay the very task being waited for, so it sleeps almost at once."""
    shares = region.shares_cores_with_owner()
    return WaitPolicy(spin_s=SHARED_CORE_SPIN_S if shares else OWN_CORE_SPIN_S)


class _NotReady(Exception):
    pass


def _remove_names(path: str) -> None:
    for entry in (path, path + TASK_FIFO_SUFFIX, path + DONE_FIFO_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry)


def _reclaim_if_stale(path: str) -> None:
    """Remove a region left by a dead owner (e.g. SIGKILL); refuse one whose owner lives."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _remove_names(path)  # FIFOs may outlive a half-created region
        return
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path!r} exists and is not a region file; choose another prefix")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    # The owner writes its pid before the magic, so a region still being created by a
    # live process is refused too.
    owner_pid = 0
    if len(head) == HEADER_BYTES:
        (owner_pid,) = struct.unpack_from("<q", head, OWNER_PID_OFFSET)
    if owner_pid and is_process_alive(owner_pid):
        raise ValueError(
            f"offload region {path!r} is owned by live process {owner_pid}; close that "
            "region (or stop its process) or use another region prefix"
        )
    logger.warning("reclaiming stale offload region %s (owner pid %d is gone)", path, owner_pid)
    _remove_names(path)


__all__ = [
    "DEFAULT_SHM_DIR",
    "FifoWakeup",
    "ShmRegion",
    "host_wait_policy",
    "region_name",
    "region_paths",
]
