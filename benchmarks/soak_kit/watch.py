"""What the soak samples while it runs, every 2 s: the gateway's RSS, fds and threads, the
/dev/shm bytes the server's processes map, vLLM's socket files, and each weaving pair's
/health status; and what a stopped server left in /dev/shm and as socket files.

The machine may be shared (another run's engines beside the soak's), so /dev/shm is
accounted by file, not by total: a file is the server's if one of its processes mapped it
at a sample, or if it appeared during the run and no live process maps it once the server
has stopped (what a killed process created and left). The total is recorded too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.soak_kit.engines import pair_statuses
from benchmarks.soak_kit.killer import health_of
from benchmarks.soak_kit.verdict import Sample
from weaver.processes import shm_files_of_processes, shm_in_use, unlink_left_over

SHM_DIR = Path("/dev/shm")
SAMPLE_EVERY_S = 2.0
MiB = 2 ** 20


def shm_files() -> dict[str, int]:
    """Every file under /dev/shm (in subdirectories too) with its size in bytes."""
    files = {}
    for root, _dirs, names in os.walk(SHM_DIR):
        for name in names:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                files[path] = os.lstat(path).st_size
    return files


def socket_files(base: Path) -> int:
    """ZeroMQ socket files under `base` (libzmq leaves them on close)."""
    count = 0
    for path in base.rglob("*"):
        with contextlib.suppress(OSError):
            count += stat.S_ISSOCK(path.lstat().st_mode)
    return count


@dataclass
class ShmLedger:
    """The /dev/shm files the soak's servers used, against what was there before."""

    before: dict[str, int] = field(default_factory=shm_files)
    seen: set[str] = field(default_factory=set)

    def note(self, paths: set[str]) -> None:
        self.seen |= paths

    def leftovers(self) -> dict[str, int]:
        """Files that were not there before and are the servers': mapped by them once, or
        mapped by no live process now."""
        now = shm_files()
        new = set(now) - set(self.before)
        in_use = shm_in_use() if new - self.seen else set()
        return {p: now[p] for p in sorted(new) if p in self.seen or p not in in_use}

    def left(self, rpc_base: Path | None, survivors: int = 0) -> dict[str, Any]:
        """What a stop left, as the verdict reads it (socket files under `rpc_base`; None:
        not counted), with the number of the server's processes that outlived it."""
        files = self.leftovers()
        return {"shm_bytes": sum(files.values()), "shm_files": sorted(files),
                "shm_total_bytes_before": sum(self.before.values()),
                "shm_total_bytes": sum(shm_files().values()),
                "socket_files": 0 if rpc_base is None else socket_files(rpc_base),
                "survivors": survivors}

    def clean_up(self) -> list[str]:
        """Unlink the leftovers no live process maps (after they were counted): the soak
        leaves nothing behind, whatever its verdict."""
        return unlink_left_over(set(self.leftovers()))


@dataclass
class PairSample:
    at_s: float
    life: int
    statuses: dict[str, str]  # hot->cold: ok, degraded, starting


class Sampler(threading.Thread):
    """Samples the server of the moment (`current()`: its gateway process and URL, and
    which life it is; None while it is down)."""

    def __init__(self, current: Callable[[], tuple[subprocess.Popen, str, int] | None],
                 start: float, ledger: ShmLedger, rpc_base: Path) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.current, self.start_at, self.ledger, self.rpc_base = current, start, ledger, rpc_base
        self.samples: list[Sample] = []
        self.pairs: list[PairSample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            server = self.current()
            if server is None:
                continue
            process, base_url, life = server
            with contextlib.suppress(psutil.Error):
                self._sample(psutil.Process(process.pid), life)
            health = health_of(base_url)
            if health is not None:
                self.pairs.append(PairSample(self.now(), life, pair_statuses(health)))

    def now(self) -> float:
        return time.monotonic() - self.start_at

    def _sample(self, gateway: psutil.Process, life: int) -> None:
        pids = [gateway.pid, *(p.pid for p in gateway.children(recursive=True))]
        mapped = shm_files_of_processes(pids)
        self.ledger.note(mapped)
        sizes = shm_files()
        self.samples.append(Sample(
            self.now(), gateway.memory_info().rss / MiB, gateway.num_fds(),
            gateway.num_threads(), sum(sizes.get(p, 0) for p in mapped) / MiB,
            socket_files(self.rpc_base), life, sum(sizes.values()) / MiB))
