"""The gateway's socket is bound before any engine starts (vllm_ext/engine/app.py
listening_socket): a port in use fails `weaver serve` at once, with the fix."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from weaver.vllm_ext.engine.app import listening_socket


def _listening() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_a_port_another_server_listens_on_is_refused_with_the_fix():
    with _listening() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            listening_socket("127.0.0.1", port)


def test_the_socket_is_bound_but_refuses_clients_until_the_gateway_serves():
    with listening_socket("127.0.0.1", 0) as held, pytest.raises(ConnectionRefusedError):
        socket.create_connection(held.getsockname(), timeout=5).close()


def test_weaver_serve_on_a_taken_port_exits_before_starting_an_engine(tmp_path):
    with _listening() as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "weaver.cli.main", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr
    assert "EngineCore" not in done.stdout + done.stderr  # nothing was started
