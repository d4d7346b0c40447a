"""CPU transport: the region lives in POSIX shared memory, the doorbells are named FIFOs.

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
from typing import TYPE_CHECKING

from weaver.offload.layout import (
    HEADER_BYTES,
    OWNER_PID_OFFSET,
    REGION_MAGIC,
    STATUS_OFFSET,
    RegionLayout,
    RegionStatus,
)
from weaver.offload.naming import (
    DEFAULT_SHM_DIR,
    DONE_FIFO_SUFFIX,
    TASK_FIFO_SUFFIX,
    region_name,
    region_paths,
    validate_region_name,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def is_process_alive(pid: int) -> bool:
    """True if pid runs and is not a zombie (a dead child not yet reaped still has a pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state letter follows the ")" that closes the command name
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)


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


class ShmRegion:
    """A mapped offload region in shared memory (implements transport.RegionTransport)."""

    def __init__(
        self,
        layout: RegionLayout,
        name: str,
        path: str,
        fd: int,
        is_owner: bool,
    ) -> None:
        self._layout = layout
        self._name = name
        self._path = path
        self._is_owner = is_owner
        self._mmap = mmap.mmap(fd, layout.total_bytes)
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self._buffer = memoryview(self._mmap)
        self._task_wakeup = FifoWakeup(path + TASK_FIFO_SUFFIX)
        self._done_wakeup = FifoWakeup(path + DONE_FIFO_SUFFIX)
        self._is_closed = False
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
        header = layout.pack_header()
        buf[len(REGION_MAGIC) : len(header)] = header[len(REGION_MAGIC) :]
        struct.pack_into("<q", buf, OWNER_PID_OFFSET, os.getpid())
        struct.pack_into("<q", buf, STATUS_OFFSET, int(RegionStatus.INITIALIZING))
        buf[: len(REGION_MAGIC)] = REGION_MAGIC
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

    # --- RegionTransport ------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> str:
        return self._path

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def layout(self) -> RegionLayout:
        return self._layout

    @property
    def buffer(self) -> memoryview:
        if self._is_closed:
            raise ValueError(f"offload region {self._name!r} is closed")
        return self._buffer

    def words(self, offset: int, count: int, fmt: str = "q") -> memoryview:
        if fmt not in ("q", "d") or offset % 8:
            raise ValueError(
                f"words need fmt 'q' or 'd' and an 8-byte aligned offset, got {fmt!r} at {offset}"
            )
        self._check_range(offset, 8 * count)
        return self.buffer[offset : offset + 8 * count].cast(fmt)

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch  # only here: naming, creating and attaching work without torch

        count = 1
        for dim in shape:
            count *= dim
        self._check_range(offset, count * dtype.itemsize)
        return torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset).view(shape)

    def _check_range(self, offset: int, num_bytes: int) -> None:
        if offset < 0 or offset + num_bytes > self._layout.total_bytes:
            raise ValueError(
                f"view [{offset}, {offset + num_bytes}) outside region of "
                f"{self._layout.total_bytes} bytes"
            )

    @property
    def task_wakeup(self) -> FifoWakeup:
        return self._task_wakeup

    @property
    def done_wakeup(self) -> FifoWakeup:
        return self._done_wakeup

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._is_owner:
            _remove_names(self._path)
            atexit.unregister(self.close)
        self._task_wakeup.close()
        self._done_wakeup.close()
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
    "is_process_alive",
    "region_name",
    "region_paths",
]
