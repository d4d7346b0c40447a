"""What one engine leaves behind once it stops, reclaimed by the process that started it
(weaver/vllm_ext/engine/app.py `open_engine`), so that restarting engines for days grows
nothing:

- **Its message queues** in /dev/shm (vLLM's psm_* segments, semaphores), which an
  EngineCore or worker that was killed never unlinks. Their names say nothing of their
  owner, so once up the EngineCore lists what it and its workers map or hold open in its
  socket directory (below; `record_engine_shm`); once the engine stopped, its server
  unlinks what the list names and no living process maps, and when the server itself was
  SIGKILLed, the next one does. Weaver's own files carry their owner's pid (a cold worker's
  regions, a gateway's pairs' directory, pools and staging segments:
  weaver/offload/naming.py) and are reclaimed by it when that process is gone.
- **Its ZeroMQ socket files.** vLLM names every IPC endpoint `ipc://<VLLM_RPC_BASE_PATH>/
  <uuid>` (vllm/utils/network_utils.py get_open_zmq_ipc_path: the front end's handshake,
  input and output sockets, the EngineCore's and worker's message-queue sockets), and
  libzmq leaves the file on close: 7 files in /tmp per engine start, also on a clean
  shutdown (measured with one tiny engine; ~3,000 after a day of test runs). Each engine
  start gets a directory of its own as its processes' VLLM_RPC_BASE_PATH, removed whole
  when the engine stops; a directory whose `weaver serve` died (SIGKILL) is removed by the
  next one.
- **Its client, held in reference cycles.** A closed engine's client (AsyncLLM, its ZeroMQ
  contexts with their I/O and reaper threads, its sockets) sits in reference cycles that
  only a full collection frees, and the gateway allocates too little between restarts
  to trigger one: under the soak's load it kept +3 threads, +8 fds and ~+50 MiB a
  restart until a full `gc.collect()` (measured: 29 threads and 82 fds after four kills,
  17 and 48 right after one collection). The gateway collects, and returns freed heap to
  the system (glibc's malloc_trim), once an engine has closed.
- **The callables vLLM caches by identity.** vLLM's `supports_kw` caches, for ever (an
  lru_cache of 128), its answer per function, and the chat renderer asks it about the
  methods of the class `maybe_make_thread_pool` builds for each engine's tokenizer: their
  closures hold that engine's tokenizer copies, ~48 MiB of the gateway's memory per
  engine restart (measured: RSS +48 MiB a restart, flat once the cache is cleared).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from weaver.offload.naming import owner_pid
from weaver.processes import SHM_DIR, is_process_alive, shm_files_of_processes, unlink_left_over

logger = logging.getLogger(__name__)

RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"
RPC_DIR_PREFIX = "weaver-rpc-"
_RPC_DIR_RE = re.compile(rf"^{RPC_DIR_PREFIX}(\d+)-")
MAX_SOCKET_PATH_BYTES = 107  # sockaddr_un.sun_path less its terminating NUL
SHM_LIST = "shm-files"  # in an engine's socket directory: the /dev/shm files it holds


# --- /dev/shm -------------------------------------------------------------------------
def shm_files_of(pids: list[int]) -> set[str]:
    """The /dev/shm files that these processes and their children hold for as long as they
    run (what a kill leaves behind)."""
    import psutil

    tree: list[int] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            tree += [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    return shm_files_of_processes(tree, kept_only=True)


def remove_left_over_shm(engine_name: str, rpc_dir: Path) -> list[str]:
    """Unlink what a dead or killed engine could not (its processes never tore down), of
    what its socket directory lists: only what no living process maps or holds open. An
    engine also maps files that are not its own: its mux group's turn table and the pool
    the gateway hosts for the group, which the other members and the gateway still use
    (unlinked with a killed member, its restart found no pool and the surviving member a
    table nobody else read); the table goes with the group's last member."""
    paths = _listed_shm(rpc_dir / SHM_LIST)
    removed = unlink_left_over(paths) if paths else []  # else no need to read every /proc
    if removed:
        logger.warning("engine %s left %d shared-memory file(s) behind; removed %s",
                       engine_name, len(removed), removed)
    return removed


def record_engine_shm() -> Path | None:
    """Run in an EngineCore once it is up (its workers and their message queues exist):
    write the /dev/shm files it and its workers hold into its socket directory, for its
    server to reclaim once the engine stopped, or the next server once that one died.
    Returns the list's path; None for an engine without a socket directory of Weaver's
    (one that neither launcher's Weaver started)."""
    rpc_dir = Path(os.environ.get(RPC_BASE_PATH_ENV) or tempfile.gettempdir())
    if not _RPC_DIR_RE.match(rpc_dir.name) or not rpc_dir.is_dir():
        return None
    listing = rpc_dir / SHM_LIST
    temporary = listing.with_name(f".{SHM_LIST}.{os.getpid()}")
    temporary.write_text("".join(f"{path}\n" for path in sorted(shm_files_of([os.getpid()]))))
    os.replace(temporary, listing)  # whole: a server reading it never sees half
    return listing


def reclaim_dead_owners_shm() -> list[str]:
    """Unlink the /dev/shm entries Weaver names after a process that is gone (a SIGKILLed
    `weaver serve`, its cold workers) and that no living process maps or holds open.
    Returns what was removed."""
    dead: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for entry in entries:
            pid = owner_pid(entry.name)
            if pid is not None and pid != os.getpid() and not is_process_alive(pid):
                dead.add(entry.path)
    directories = {path for path in dead if os.path.isdir(path)}
    files = dead - directories
    removed = unlink_left_over(files) if files else []  # else no need to read every /proc
    for path in sorted(directories):  # a dead gateway's pairs' directory: nobody maps it
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.warning("removed %d shared-memory file(s) of stopped Weaver processes: %s",
                       len(removed), sorted(removed))
    return removed


# --- ZeroMQ socket files ----------------------------------------------------------------
def rpc_base_path() -> Path:
    """Where vLLM puts its socket files: the user's VLLM_RPC_BASE_PATH, else the temp dir
    (vllm/envs.py's default). While an engine of this process spawns, the variable names
    that engine's own directory (weaver/vllm_ext/engine/app.py sets it for the spawn):
    its parent is the base then."""
    base = Path(os.environ.get(RPC_BASE_PATH_ENV) or tempfile.gettempdir())
    if base.name.startswith(f"{RPC_DIR_PREFIX}{os.getpid()}-"):
        return base.parent
    return base


def make_rpc_dir() -> Path:
    """A new directory for one engine start's socket files, named by this process's pid
    (its owner). ValueError saying the fix when a socket's path in it (the directory, a
    '/', a 36-character uuid) would not fit AF_UNIX's 107 bytes."""
    base = rpc_base_path()
    # mkdtemp's random part is 8 characters.
    longest = len(os.fsencode(base)) + len(f"/{RPC_DIR_PREFIX}{os.getpid()}-12345678/") + 36
    if longest > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"{RPC_BASE_PATH_ENV}={base} is too long for vLLM's socket files "
                         f"({longest} bytes, at most {MAX_SOCKET_PATH_BYTES} in a socket "
                         f"path); set {RPC_BASE_PATH_ENV} to a shorter directory (/tmp)")
    return Path(tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-", dir=base))


def remove_rpc_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def reclaim_dead_owners_rpc_dirs() -> list[Path]:
    """Remove the engine socket directories whose owner process is gone (a `weaver serve`
    that was SIGKILLed), and the /dev/shm files their lists name that no living process
    maps; those of live owners stay. Returns the directories removed."""
    base = rpc_base_path()
    dead: list[Path] = []
    with contextlib.suppress(OSError), os.scandir(base) as entries:
        for entry in entries:
            match = _RPC_DIR_RE.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False) \
                    and not is_process_alive(int(match.group(1))):
                dead.append(Path(entry.path))
    listed = set().union(*(_listed_shm(path / SHM_LIST) for path in dead))
    # One look at every process's mappings for all the lists (unlink_left_over reads /proc).
    unlinked = unlink_left_over(listed) if listed else []
    if unlinked:
        logger.warning("removed %d shared-memory file(s) the engines of stopped Weaver "
                       "servers held: %s", len(unlinked), unlinked)
    for path in dead:
        remove_rpc_dir(path)
    if dead:
        logger.warning("removed %d engine socket director(ies) of stopped Weaver servers "
                       "from %s", len(dead), base)
    return dead


def _listed_shm(listing: Path) -> set[str]:
    """The /dev/shm files an engine held (its SHM_LIST): its message queues and semaphores,
    which name no owner; none when it wrote no list. A file whose name carries a living
    owner's pid is that owner's to remove, whoever maps it at the moment (a hot engine
    lists the region of its cold engine, which keeps serving it to the next hot engine)."""
    with contextlib.suppress(OSError):
        return {line for line in listing.read_text().splitlines()
                if line.startswith(f"{SHM_DIR}/") and not _has_living_owner(line)}
    return set()


def _has_living_owner(path: str) -> bool:
    pid = owner_pid(os.path.basename(path))
    return pid is not None and is_process_alive(pid)


# --- memory of a closed engine ----------------------------------------------------------
def release_closed_engine_memory() -> None:
    """Free what a closed engine's client left in reference cycles (its ZeroMQ contexts'
    threads and sockets with it), then give the freed heap back to the system."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --- callables cached by identity -------------------------------------------------------
def forget_closed_engine_callables() -> None:
    """Drop vLLM's cached `supports_kw` answers, which hold closed engines' tokenizers (see
    the module docstring). A cache: the next call computes its answer again."""
    from vllm.utils.func_utils import _supports_kw

    _supports_kw.cache_clear()
