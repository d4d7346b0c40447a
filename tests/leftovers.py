"""What a test module leaves behind: processes it started that still run once its
fixtures are torn down. tests/conftest.py holds every module to leaving none.

A plain module, imported by name: pytest puts tests/ on sys.path."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from weaver.processes import is_process_alive, is_resource_tracker

# How long what a module started gets to exit after its fixtures are torn down: an
# engine's teardown is asynchronous in part.
GRACE_S = 20.0


def live_descendants() -> dict[int, str]:
    """This process's descendants that have not exited, with their command lines; not its
    own multiprocessing resource tracker, which lives as long as it does."""
    me, children = os.getpid(), {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not is_process_alive(child.pid) or (
                    child.ppid() == me and is_resource_tracker(child.pid)):
                continue
            children[child.pid] = " ".join(child.cmdline())[:160]
    return children


def left_running(before: set[int]) -> dict[int, str]:
    """The descendants not in `before` still running after up to GRACE_S."""
    deadline = time.monotonic() + GRACE_S
    while True:
        left = {pid: command for pid, command in live_descendants().items()
                if pid not in before}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill(processes: dict[int, str]) -> None:
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
