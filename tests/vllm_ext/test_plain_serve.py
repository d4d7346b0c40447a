"""What a plain `vllm serve` engine with a Weaver block leaves behind is reclaimed
(weaver/vllm_ext/plain_serve.py): by its own front end when it exits, by the next such
server when it was SIGKILLed. Real processes stand in for vLLM's (a front end that runs
the plugin's hook, an "EngineCore" that maps what vLLM's do and lists it as the plugin's
EngineCore hook does); the soak's plain `vllm serve` phase checks the real servers
(benchmarks/soak.py --plain-vllm)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import pytest

from weaver.mux.table import GroupLayout, TurnTable
from weaver.mux.turns import Mode
from weaver.offload.naming import cold_region_prefix
from weaver.vllm_ext.engine.leftovers import RPC_BASE_PATH_ENV, SHM_LIST
from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV
from weaver.vllm_ext.plain_serve import is_plain_weaver_engine

MUX_BLOCK = {"group": "g", "member": "a", "members": {"a": 1.0, "b": 1.0},
             "mode": "temporal"}

# A front end: the plugin's hook, then an engine process that maps the files named on the
# command line (as vLLM's EngineCore and worker map their message queues and the group's
# turn table) and lists them (as the plugin's EngineCore hook does); once the list is
# there the engine is SIGKILLed, as vLLM's default --shutdown-timeout 0 kills its worker,
# and the front end exits normally (its atexit runs) or waits to be SIGKILLed itself.
FRONT_END = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from types import SimpleNamespace
    from weaver.vllm_ext.plain_serve import look_after_front_end

    mode, paths = sys.argv[1], sys.argv[2:]
    config = SimpleNamespace(additional_config={"weaver": {"mux": {"group": "g"}}})
    rpc_dir = look_after_front_end(config)
    print(rpc_dir, flush=True)
    engine = subprocess.Popen([sys.executable, "-c", '''
    import mmap, sys, time
    from weaver.vllm_ext.engine.leftovers import record_engine_shm
    files = [open(path, "r+b") for path in sys.argv[1:]]
    views = [mmap.mmap(f.fileno(), 0) for f in files]
    record_engine_shm()
    time.sleep(600)
    ''', *paths])
    while not (rpc_dir / "shm-files").exists():
        time.sleep(0.02)
    engine.kill()
    engine.wait()
    if mode == "wait":
        print("listed", flush=True)
        time.sleep(600)
""")


def start_front_end(mode: str, *paths: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FRONT_END, mode, *paths], env=env,
                            stdout=subprocess.PIPE, text=True)


@pytest.fixture
def runtime_dir():
    """In /dev/shm, where a group's table is by default (what an engine lists is there)."""
    path = Path(tempfile.mkdtemp(prefix=f"wvtest{os.getpid()}-runtime-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def env(runtime_dir):
    # Short, as a real base is: pytest's tmp_path leaves no room for a socket's name.
    base = Path(tempfile.mkdtemp(prefix="wv-"))
    environment = {k: v for k, v in os.environ.items() if k != GATEWAY_PID_ENV}
    yield {**environment, RPC_BASE_PATH_ENV: str(base), "WEAVER_RUNTIME_DIR": str(runtime_dir)}
    leftovers = list(base.iterdir())
    shutil.rmtree(base)
    assert not leftovers, f"left behind in the socket base: {leftovers}"


def test_an_engine_with_a_weaver_block_is_looked_after_unless_weaver_serve_builds_it(
        monkeypatch):
    monkeypatch.delenv(GATEWAY_PID_ENV, raising=False)
    assert is_plain_weaver_engine({"weaver": {"role": "cold", "pair": "p1"}})
    assert is_plain_weaver_engine({"weaver": {"mux": MUX_BLOCK}})
    assert not is_plain_weaver_engine({"weaver": {"split": {"lm_head": 4}}})
    assert not is_plain_weaver_engine(None)
    # `weaver serve` names itself while it builds an engine's config (engine/app.py).
    monkeypatch.setenv(GATEWAY_PID_ENV, str(os.getpid()))
    assert not is_plain_weaver_engine({"weaver": {"mux": MUX_BLOCK}})


def test_the_front_end_reclaims_its_killed_workers_queues_and_its_groups_table_at_exit(
        env, runtime_dir):
    """vLLM's default --shutdown-timeout 0 kills the worker on SIGTERM before it unlinks
    its message queues; the member that stops last takes its group's turn table along."""
    queue = shared_memory.SharedMemory(create=True, size=4096)
    layout = GroupLayout("g", ("a", "b"), (1.0, 1.0), Mode.TEMPORAL)
    table = TurnTable.open(layout, runtime_dir)  # the other member, still running
    try:
        queue_path = f"/dev/shm/{queue.name}"
        queue.close()  # only the engine maps it now
        front_end = start_front_end("exit", queue_path, str(table.path), env=env)
        rpc_dir = Path(front_end.stdout.readline().strip())
        assert rpc_dir.parent == Path(env[RPC_BASE_PATH_ENV])
        assert front_end.wait(timeout=60) == 0
        assert not os.path.exists(queue_path)
        assert table.path.exists()  # the other member holds it
        assert not rpc_dir.exists()

        table.close()  # the other member stops last: its exit takes the table
        front_end = start_front_end("exit", str(table.path), env=env)
        assert front_end.wait(timeout=60) == 0
        assert not table.path.exists()
    finally:
        table.close()
        table.path.unlink(missing_ok=True)
        if os.path.exists(f"/dev/shm/{queue.name}"):
            queue.unlink()


def test_at_exit_the_dead_workers_region_and_pair_files_go_and_the_living_ones_stay(
        env, runtime_dir):
    """A cold worker's region is made after its engine listed what it holds, and a worker
    killed on SIGTERM withdraws none of its pair's files."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now: a killed worker's
    region = Path(f"/dev/shm/{cold_region_prefix(dead.pid, 1)}-hot-p1-0123abcd")
    region.write_bytes(b"\0" * 4096)
    (runtime_dir / "p1.cold.json").write_text(json.dumps({"pid": dead.pid}))
    (runtime_dir / "p1.hot.json").write_text(json.dumps({"pid": os.getpid()}))
    try:
        assert start_front_end("exit", env=env).wait(timeout=60) == 0
        assert not region.exists()
        assert sorted(p.name for p in runtime_dir.iterdir()) == ["p1.hot.json"]
    finally:
        region.unlink(missing_ok=True)


def test_the_next_server_reclaims_what_a_sigkilled_one_left(env):
    queue = shared_memory.SharedMemory(create=True, size=4096)
    queue_path = f"/dev/shm/{queue.name}"
    queue.close()
    try:
        killed = start_front_end("wait", queue_path, env=env)
        rpc_dir = Path(killed.stdout.readline().strip())
        assert killed.stdout.readline().strip() == "listed"
        assert queue_path in (rpc_dir / SHM_LIST).read_text().split()
        killed.send_signal(signal.SIGKILL)  # the whole server at once: no atexit
        killed.wait(timeout=60)
        assert os.path.exists(queue_path) and rpc_dir.exists()

        successor = start_front_end("exit", env=env)
        assert successor.wait(timeout=60) == 0
        assert not os.path.exists(queue_path)
        assert not rpc_dir.exists()
    finally:
        if os.path.exists(queue_path):
            queue.unlink()


def test_the_turn_tables_directory_goes_with_its_last_file(monkeypatch):
    """Weaver's default runtime directory (not one the user named) is removed once
    empty, and a table opened as it goes makes it again."""
    from weaver import runtime_dirs

    monkeypatch.delenv(runtime_dirs.RUNTIME_DIR_ENV, raising=False)
    monkeypatch.setattr(os, "getuid", lambda: 4_000_000 + os.getpid())  # a dir of its own
    directory = runtime_dirs.shared_dir("mux")
    layout = GroupLayout(f"g{time.monotonic_ns()}", ("a",), (1.0,), Mode.TEMPORAL)
    calls = []

    def create_after_a_removal() -> int:  # another server's exit removes it in between
        if not calls:
            calls.append(directory.rmdir())
        return os.open(directory / "t", os.O_CREAT | os.O_RDWR, 0o600)

    try:
        os.close(runtime_dirs.create_in(directory, create_after_a_removal))
        assert not runtime_dirs.remove_default_if_empty("mux")  # it holds a file
        (directory / "t").unlink()
        table = TurnTable.open(layout)
        assert table.path.parent == directory
        table.close()
        table.path.unlink()
        assert runtime_dirs.remove_default_if_empty("mux") and not directory.exists()
        monkeypatch.setenv(runtime_dirs.RUNTIME_DIR_ENV, str(directory))
        directory.mkdir()
        assert not runtime_dirs.remove_default_if_empty("mux")  # the user's stays
    finally:
        for leftover in directory.glob("*"):
            leftover.unlink()
        runtime_dirs.remove_if_empty(directory)


def test_a_config_without_a_block_is_left_to_vllm(monkeypatch):
    from weaver.vllm_ext import plain_serve

    monkeypatch.delenv(GATEWAY_PID_ENV, raising=False)
    config = SimpleNamespace(additional_config={})
    assert plain_serve.look_after_front_end(config) is None
    assert GATEWAY_PID_ENV not in os.environ
