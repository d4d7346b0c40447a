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
import tempfile
import weakref
from pathlib import Path

import pytest
import zmq

from weaver.vllm_ext.engine.leftovers import (
    RPC_BASE_PATH_ENV,
    forget_closed_engine_callables,
    make_rpc_dir,
    reclaim_dead_owners_rpc_dirs,
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
    exited = subprocess.Popen(["true"])
    exited.wait()  # its pid is now free: a server that was SIGKILLed
    dead = rpc_base / f"weaver-rpc-{exited.pid}-abc"
    live = make_rpc_dir()  # this process's
    other = rpc_base / "someone-elses"
    for path in (dead, other):
        path.mkdir()
    (dead / "socket").touch()
    assert reclaim_dead_owners_rpc_dirs() == [dead]
    assert not dead.exists() and live.exists() and other.exists()


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
