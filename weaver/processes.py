"""Whether a process still runs: for the owners of shared regions (weaver.offload.shm) and of
half-built model folders (weaver.models.store), whose leftovers may be reclaimed once they
are gone; whether it is multiprocessing's resource tracker (which the reapers leave be);
and which /dev/shm files processes hold, so that what a stopped or killed one could not
unlink is found (weaver/vllm_ext/engine/app.py, weaver/bench/server_process.py).
Pure Python, over /proc."""

from __future__ import annotations

import contextlib
import os


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


def is_resource_tracker(pid: int) -> bool:
    """Whether process `pid` is multiprocessing's resource tracker (its command line is
    `python -c 'from multiprocessing.resource_tracker import main;main(FD)'`): it ignores
    SIGTERM and exits by itself once every process sharing it has exited, after unlinking
    what it still tracks. False once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (vLLM's message queues, Weaver's regions and
    pools, semaphores) or holds open (a region's doorbell pipes); empty once it is gone."""
    paths: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        paths.update(line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                     for line in maps if "/dev/shm/" in line)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    paths.add(target)
    return paths


def shm_in_use() -> set[str]:
    """The /dev/shm files that some live process maps or holds open."""
    return {path for entry in os.listdir("/proc") if entry.isdigit()
            for path in shm_files_of(int(entry))}
