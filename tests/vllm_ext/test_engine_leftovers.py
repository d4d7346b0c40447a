"""What an engine leaves behind once it stops (weaver/vllm_ext/engine/leftovers.py): its
socket files go to a directory of its own, removed with it (and by the next server when
its owner died), and vLLM's cached answers about its tokenizer's methods are dropped.
vLLM's own functions, no engine: tests/server/test_serve_e2e.py checks a real server's
directories across engine kills and its stop."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import pytest
import zmq

from weaver.offload.naming import (
    cold_region_prefix,
    gateway_prefix,
    owner_pid,
    region_name,
    staging_prefix,
)
from weaver.vllm_ext.engine.leftovers import (
    RPC_BASE_PATH_ENV,
    SHM_LIST,
    forget_closed_engine_callables,
    make_rpc_dir,
    reclaim_dead_owners_rpc_dirs,
    reclaim_dead_owners_shm,
    release_closed_engine_memory,
    remove_left_over_shm,
    remove_rpc_dir,
)


@pytest.fixture
def rpc_base(monkeypatch):
    # Short, as a real base is: pytest's tmp_path leaves no room for a socket's name.
    base = Path(tempfile.mkdtemp(prefix="wv-"))
    monkeypatch.setenv(RPC_BASE_PATH_ENV, str(base))
    yield base
    shutil.rmtree(base)


def test_an_engine_starts_sockets_in_its_own_directory_removed_with_it(rpc_base, monkeypatch):
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    rpc_dir = make_rpc_dir()
    assert rpc_dir.parent == rpc_base and rpc_dir.name.startswith(f"weaver-rpc-{os.getpid()}-")
    # vLLM reads its base path when it names an endpoint: what the engine's processes see.
    monkeypatch.setenv(RPC_BASE_PATH_ENV, str(rpc_dir))
    address = get_open_zmq_ipc_path()
    assert address.startswith(f"ipc://{rpc_dir}/")
    context = zmq.Context()
    try:
        context.socket(zmq.PULL).bind(address)
    finally:
        context.destroy(linger=0)  # closes the socket
    # Another engine starting meanwhile gets a directory beside it, not inside.
    assert make_rpc_dir().parent == rpc_base
    # Why a directory of its own: libzmq leaves the file of a closed socket.
    assert [p.name for p in rpc_dir.iterdir()] == [address.rsplit("/", 1)[1]]
    remove_rpc_dir(rpc_dir)
    assert not rpc_dir.exists()


def test_a_base_too_long_for_a_socket_path_is_refused_saying_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(RPC_BASE_PATH_ENV, str(tmp_path / ("x" * 80)))
    with pytest.raises(ValueError, match="VLLM_RPC_BASE_PATH"):
        make_rpc_dir()


def test_the_directories_of_a_dead_server_are_reclaimed_and_a_live_ones_kept(rpc_base):
    dead = rpc_base / f"weaver-rpc-{_dead_pid()}-abc"
    live = make_rpc_dir()  # this process's
    other = rpc_base / "someone-elses"
    for path in (dead, other):
        path.mkdir()
    (dead / "socket").touch()
    assert reclaim_dead_owners_rpc_dirs() == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def _dead_pid() -> int:
    exited = subprocess.Popen(["true"])
    exited.wait()  # its pid is now free: a process that was SIGKILLed
    return exited.pid


def _record_as_an_engine(rpc_dir: Path, *paths: str) -> str:
    """What an EngineCore does once up (leftovers.record_engine_shm, run from the plugin's
    EngineCore hook): a child process with `rpc_dir` as its socket directory maps `paths`,
    lists what it holds there, and exits without unlinking anything, as a killed engine.
    Returns the list's path, as it printed it."""
    code = ("import mmap, sys\n"
            "from weaver.vllm_ext.engine.leftovers import record_engine_shm\n"
            "files = [open(path, 'r+b') for path in sys.argv[1:]]\n"
            "views = [mmap.mmap(f.fileno(), 0) for f in files]\n"
            "print(record_engine_shm())\n")
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True,
                          text=True, check=True,
                          env={**os.environ, RPC_BASE_PATH_ENV: str(rpc_dir)})
    return done.stdout.strip()


def test_an_engine_outside_weavers_socket_directories_lists_nothing(rpc_base):
    assert _record_as_an_engine(rpc_base) == "None"  # vLLM's default base: not Weaver's


def test_a_dead_servers_engine_message_queues_are_reclaimed_from_its_list(rpc_base):
    """A SIGKILLed server's engines leave vLLM's psm_* segments, whose names say nothing
    of their owner: the list its EngineCore wrote into its socket directory names them, and
    the next server unlinks those no living process maps."""
    from multiprocessing import shared_memory

    dead_dir = rpc_base / f"weaver-rpc-{_dead_pid()}-abc"
    dead_dir.mkdir()
    left = shared_memory.SharedMemory(create=True, size=64)
    mapped = shared_memory.SharedMemory(create=True, size=64)  # a living process maps it
    try:
        listing = _record_as_an_engine(dead_dir, f"/dev/shm/{left.name}",
                                       f"/dev/shm/{mapped.name}")
        assert listing == str(dead_dir / SHM_LIST)
        assert (dead_dir / SHM_LIST).read_text().count("/dev/shm/psm_") == 2
        left.close()  # nobody maps it any more: what a killed engine leaves
        assert reclaim_dead_owners_rpc_dirs() == [dead_dir]
        assert not os.path.exists(f"/dev/shm/{left.name}")
        assert os.path.exists(f"/dev/shm/{mapped.name}")
    finally:
        mapped.close()
        mapped.unlink()
        with pytest.raises(FileNotFoundError):
            left.unlink()  # already gone


def test_weavers_files_of_dead_processes_are_reclaimed_and_the_living_ones_kept():
    dead, alive = _dead_pid(), os.getppid()
    names = {
        "dead_region": region_name(cold_region_prefix(dead, 1), "hot", "p0-hot.cold"),
        "dead_staging": f"{staging_prefix(dead)}abc",
        "live_region": region_name(cold_region_prefix(alive, 1), "hot", "p0-hot.cold"),
        "unrelated": f"wvtest-{dead}-other",
    }
    assert owner_pid(names["dead_region"]) == dead
    assert owner_pid(f"{gateway_prefix(dead)}-pairs") == dead
    assert owner_pid(names["dead_staging"]) == dead and owner_pid("psm_1234") is None
    pairs_dir = Path("/dev/shm") / f"{gateway_prefix(dead)}-pairs"
    pairs_dir.mkdir()
    (pairs_dir / "p0.cold").write_text("{}")
    paths = {key: Path("/dev/shm") / name for key, name in names.items()}
    try:
        for path in paths.values():
            path.touch()
        removed = reclaim_dead_owners_shm()
        assert {str(paths["dead_region"]), str(paths["dead_staging"]), str(pairs_dir)} \
            <= set(removed)
        assert not paths["dead_region"].exists() and not pairs_dir.exists()
        assert paths["live_region"].exists() and paths["unrelated"].exists()
    finally:
        shutil.rmtree(pairs_dir, ignore_errors=True)
        for path in paths.values():
            path.unlink(missing_ok=True)


def test_a_dead_owners_file_that_a_living_process_maps_stays():
    """A killed cold worker's region that its live gateway's hot engine still maps."""
    import mmap

    path = Path("/dev/shm") / region_name(cold_region_prefix(_dead_pid(), 1), "hot", "pair")
    path.write_bytes(b"\0" * 4096)
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert str(path) not in reclaim_dead_owners_shm()
            assert path.exists()
        assert str(path) in reclaim_dead_owners_shm()
    finally:
        path.unlink(missing_ok=True)


def test_a_closed_clients_cycles_and_their_zmq_threads_are_freed():
    """A closed engine client's ZeroMQ context, in a reference cycle, keeps its I/O and
    reaper threads until a full collection (the soak's +3 threads a restart)."""

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    class Client:  # stands for AsyncLLM and its core client, which refer to each other
        pass

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # the gateway allocates too little between restarts for a collection
    try:
        before = threads()
        client = Client()
        client.context = zmq.Context()
        client.context.socket(zmq.PULL).close()  # its threads start with a first socket
        client.itself = client
        del client
        assert threads() >= before + 2  # unreachable, yet its threads run
        release_closed_engine_memory()
        assert threads() == before
    finally:
        if was_enabled:
            gc.enable()


def test_closing_an_engine_drops_vllms_cached_answers_about_its_tokenizer():
    """vLLM's chat renderer asks `supports_kw` about the methods of the class that
    `maybe_make_thread_pool` makes for each engine's tokenizer; the cache held those
    classes (and the tokenizer copies in their closures) for ever: ~48 MiB a restart."""
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.hf import maybe_make_thread_pool
    from vllm.utils.func_utils import supports_kw

    from weaver.models.registry import prepare_model

    tokenizer = maybe_make_thread_pool(get_tokenizer(str(prepare_model("tiny-llama-a"))), 2)
    # The method's function: its closure holds the tokenizer's copies.
    method = weakref.ref(type(tokenizer).apply_chat_template)
    supports_kw(tokenizer.apply_chat_template, "tools", allow_var_kwargs=False)
    del tokenizer
    gc.collect()
    assert method() is not None  # held by vLLM's cache: the leak
    forget_closed_engine_callables()
    gc.collect()
    assert method() is None


def test_what_a_dead_engine_shared_with_living_processes_stays(rpc_base):
    """A killed mux member held its group's turn table and the pool the gateway hosts; the
    other member and the gateway map them still. Its own message queue goes; the table
    once its last holder is gone."""
    import mmap

    shared = Path("/dev/shm") / f"wvtest{os.getpid()}-group-kvpool"
    own = Path("/dev/shm") / f"wvtest{os.getpid()}-psm"
    for path in (shared, own):
        path.write_bytes(b"\0" * 4096)
    rpc_dir = make_rpc_dir()
    try:
        _record_as_an_engine(rpc_dir, str(shared), str(own))
        with open(shared, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a living member
            assert remove_left_over_shm("mux-a", rpc_dir) == [str(own)]
            assert shared.exists() and not own.exists()
        assert remove_left_over_shm("mux-a", rpc_dir) == [str(shared)]
    finally:
        for path in (shared, own):
            path.unlink(missing_ok=True)
