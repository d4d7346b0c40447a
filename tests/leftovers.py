"""What the suite leaves behind: processes a test module started that still run once its
fixtures are torn down, and /dev/shm entries (shared memory, semaphores, a region's pipes)
that appeared during the session and that no live process holds. tests/conftest.py holds
every module to leaving no process and the session to leaving no entry.

A plain module, imported by name: pytest puts tests/ on sys.path."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import psutil

from weaver.offload.naming import owner_pid
from weaver.processes import SHM_DIR, is_process_alive, is_resource_tracker, shm_in_use

SHM = Path(SHM_DIR)

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


def shm_entries() -> set[str]:
    """The names in /dev/shm now."""
    return {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()


def shm_left(before: set[str], grace_s: float = GRACE_S) -> dict[str, float]:
    """The /dev/shm entries not in `before` that no live process maps or holds open after
    up to `grace_s` (an engine's own atexit clean-up may still be running), with their
    modification times (about when they were created: a semaphore or a segment is sized
    once). An entry named after a live process outside this session (a `weaver serve` or a
    soak run beside the suite: its pairs' directory, its pools) is that process's, not
    the suite's: neither counted nor removed."""
    deadline = time.monotonic() + grace_s
    while True:
        held = {Path(path).name for path in shm_in_use()}
        session = {os.getpid(), *live_descendants()}
        left = {}
        for name in shm_entries() - before - held:
            if _owned_outside(session, name):
                continue
            with contextlib.suppress(FileNotFoundError):
                left[name] = (SHM / name).stat().st_mtime
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _owned_outside(session: set[int], name: str) -> bool:
    """Whether `name` carries the pid of a live process that is not one of `session`."""
    pid = owner_pid(name)
    return pid is not None and pid not in session and is_process_alive(pid)


def suspects(created_at: float, windows: list[tuple[str, float, float]]) -> list[str]:
    """The modules that were running (a window of (module, start, end) wall-clock times)
    when an entry was created: with two workers, one of them made it."""
    return [module for module, start, end in windows if start - 1.0 <= created_at <= end + 1.0]


def describe_shm_left(left: dict[str, float], windows: list[tuple[str, float, float]]) -> str:
    return describe_left(f"the suite left {len(left)} entries in /dev/shm that no process "
                         "holds (removed now); the modules running when each was created:",
                         left, windows)


def describe_left(header: str, left: dict[str, float],
                  windows: list[tuple[str, float, float]]) -> str:
    """`header`, then each entry left (name -> when it was made) with the modules that ran
    then."""
    lines = [header]
    for name, created_at in sorted(left.items(), key=lambda item: item[1]):
        when = time.strftime("%H:%M:%S", time.localtime(created_at))
        lines.append(f"  {name} ({when}): {', '.join(suspects(created_at, windows)) or '?'}")
    return "\n".join(lines)


def remove_shm(names: set[str] | dict[str, float]) -> None:
    for name in names:
        path = SHM / name
        if path.is_dir():  # a pairs' or mux runtime directory
            shutil.rmtree(path, ignore_errors=True)
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# vLLM's ZeroMQ socket files. The session points VLLM_RPC_BASE_PATH at a directory of its
# own, which every engine the tests start inherits: Weaver's engines put theirs in a
# directory per engine start (weaver-rpc-<pid>-*, weaver/vllm_ext/engine/leftovers.py) and
# remove it when the engine stops; a vLLM engine started directly (the plugin's `vllm
# serve`, an offline LLM) leaves its files, which go with the session's directory.
def make_rpc_base() -> Path:
    """The session's directory, named by its pid; those of sessions that were killed (no
    teardown ran) are removed first. Short: a plain `vllm serve` the tests start nests the
    harness's directory and its engine's own in it, under a socket path's 107 bytes."""
    import re
    import shutil
    import tempfile

    base = Path(tempfile.gettempdir())
    for path in base.glob("wt-rpc-*"):
        match = re.match(r"wt-rpc-(\d+)-", path.name)
        if match and not is_process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"wt-rpc-{os.getpid()}-", dir=base))


def rpc_dirs_left(base: Path) -> dict[str, float]:
    """Weaver's engine socket directories still in `base`, with their modification times."""
    from weaver.vllm_ext.engine.leftovers import RPC_DIR_PREFIX

    left = {}
    for path in base.glob(f"{RPC_DIR_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            left[path.name] = path.stat().st_mtime
    return left


def describe_rpc_left(left: dict[str, float], windows: list[tuple[str, float, float]]) -> str:
    return describe_left(f"the suite left {len(left)} engine socket directories (weaver-rpc-*: "
                         "an engine start whose stop did not remove its own); the modules "
                         "running when each was made:", left, windows)
