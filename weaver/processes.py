"""Whether a process still runs: for the owners of shared regions (weaver.offload.shm) and of
half-built model folders (weaver.models.store), whose leftovers may be reclaimed once they
are gone; whether it is multiprocessing's resource tracker (which the reapers leave be);
and which /dev/shm files processes hold, so that what a stopped or killed one could not
unlink is found (weaver/vllm_ext/engine/app.py, weaver/bench/server_process.py).
Pure Python, over /proc."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable


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


SHM_DIR = "/dev/shm"


def shm_files_of(pid: int, names_by_inode: dict[int, set[str]] | None = None,
                 kept_only: bool = False) -> set[str]:
    """The /dev/shm files process `pid` maps (vLLM's message queues, Weaver's regions and
    pools, semaphores) or holds open (a region's doorbell pipes); empty once it is gone.
    `kept_only`: of the files it has open without mapping them, only pipes, which it holds
    for as long as it runs; a regular file it has open is one it reads or writes at that
    moment (a weaving pair's JSON, weaver/weaving/rendezvous.py), someone else's to remove,
    so not among what it would leave behind if killed.

    A POSIX semaphore (multiprocessing's `sem.mp-*`) is mapped under another name: glibc's
    sem_open creates a temporary file, maps it, links it to the semaphore's name and
    unlinks the temporary one, so the mapping reads `/dev/shm/sem.XXXXXX (deleted)`. The
    files are found by the mapping's inode instead (`names_by_inode`: /dev/shm's names by
    inode, listed once for many processes; listed here when None)."""
    if names_by_inode is None:
        names_by_inode = shm_names_by_inode()
    paths: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if f"{SHM_DIR}/" not in line:
                continue
            fields = line.split(None, 5)  # address perms offset device inode path
            paths.add(fields[5].strip().removesuffix(" (deleted)"))
            paths.update(names_by_inode.get(int(fields[4]), ()))
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(f"{SHM_DIR}/") and \
                        (not kept_only or stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)):
                    paths.add(target)
    return paths


def shm_names_by_inode() -> dict[int, set[str]]:
    names: dict[int, set[str]] = {}
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                names.setdefault(entry.inode(), set()).add(entry.path)
    return names


def shm_files_of_processes(pids: Iterable[int], kept_only: bool = False) -> set[str]:
    """The /dev/shm files any of these processes maps or holds open (/dev/shm listed once
    for all of them; `kept_only` as in shm_files_of)."""
    names_by_inode = shm_names_by_inode()
    return {path for pid in pids for path in shm_files_of(pid, names_by_inode, kept_only)}


def shm_in_use() -> set[str]:
    """The /dev/shm files that some live process maps or holds open."""
    return shm_files_of_processes(int(entry) for entry in os.listdir("/proc")
                                  if entry.isdigit())


def unlink_left_over(paths: set[str]) -> list[str]:
    """Unlink those of `paths` that no live process maps or holds open any more (a
    stopped hot server mapped its cold server's region, which must stay). For what a
    killed process mapped: its regions, and on a GPU torch's CUDA IPC reference-count
    files (torch_<pid>_*) and the driver's cuda.shm.* files, which only a clean exit
    removes."""
    removed = []
    for path in sorted(paths - shm_in_use()):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
