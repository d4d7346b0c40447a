"""The soak's `weaver serve`, started, stopped with SIGTERM and started again on one port, so
the load keeps its URL across a restart (requests sent while it is down meet a refused
connection: outcomes.py's `server_down`).

A stop is measured as production sees it: SIGTERM, then the server and every process it
started get to end by themselves (120 s and 30 s) before anything is counted; only then
does the harness (weaver/bench/server_process.py) kill what is still there, and what
/dev/shm still holds is the server's own doing.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.soak_kit.engines import engines_of
from benchmarks.soak_kit.watch import ShmLedger
from weaver.bench.prom_histogram import read_counter
from weaver.bench.server_process import RPC_BASE_PATH_ENV, RunningServer, free_port, weaver_server

STOP_TIMEOUT_S = 120.0  # the gateway drains (serving.drain_grace_s, 30 s) then stops engines
CHILDREN_EXIT_S = 30.0


@dataclass
class Restart:
    at_s: float  # SIGTERM sent, since the load started
    stopped_at_s: float | None = None  # the server had exited
    back_at_s: float | None = None  # the next one answered /health 200
    exit_code: int | None = None
    error: str | None = None  # why it did not come back

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ServerLives:
    """One `weaver serve CONFIG` at a time on a fixed port; `life` counts its starts."""

    def __init__(self, config: Path | None, api_key: str, log_dir: Path, rpc_base: Path,
                 ledger: ShmLedger) -> None:
        self.config, self.api_key, self.log_dir = config, api_key, log_dir
        self.rpc_base, self.ledger = rpc_base, ledger
        self.port = free_port()
        self.life = -1
        self.server: RunningServer | None = None
        self.engine_restarts: dict[str, float] = {}  # /metrics' count, summed over lives
        self._stack: contextlib.ExitStack | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def current(self) -> tuple[subprocess.Popen, str, int] | None:
        server = self.server
        return None if server is None else (server.process, server.base_url, self.life)

    def current_url(self) -> str | None:
        return None if self.server is None else self.server.base_url

    def start(self) -> RunningServer:
        """Start and wait until /health answers 200 (raises when it does not)."""
        self.life += 1
        stack = contextlib.ExitStack()
        log = self.log_dir / f"life{self.life}.serve.log"
        try:
            self.server = stack.enter_context(weaver_server(
                self.config, log, "--api-key", self.api_key, port=self.port,
                env_overrides={RPC_BASE_PATH_ENV: str(self.rpc_base)}))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self.server

    def stop(self) -> tuple[int | None, int]:
        """SIGTERM and wait; returns the exit code and how many of its processes outlived
        it (then killed by the harness)."""
        server, self.server = self.server, None
        if server is None:
            return None, 0
        self._count_restarts(server)
        self.ledger.note(server.mapped_shm())
        children = server.descendants()
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = server.stop(signal.SIGTERM, timeout_s=STOP_TIMEOUT_S)
        _, survivors = psutil.wait_procs(children, timeout=CHILDREN_EXIT_S)
        assert self._stack is not None
        self._stack.close()
        return code, len(survivors)

    def health(self) -> dict[str, Any]:
        assert self.server is not None
        return self.server.health().json()

    def _count_restarts(self, server: RunningServer) -> None:
        try:
            engines = engines_of(server.health().json())
            metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        except (httpx.HTTPError, ValueError):
            return
        for name in engines:
            count = read_counter(metrics, "weaver_engine_restarts", {"model": name}) or 0
            self.engine_restarts[name] = self.engine_restarts.get(name, 0) + count


def restart(lives: ServerLives, start: float) -> tuple[Restart, dict[str, Any]]:
    """One SIGTERM/restart cycle of the whole server: the cycle, and what the stop left."""
    cycle = Restart(at_s=time.monotonic() - start)
    print(f"[{cycle.at_s:6.0f} s] SIGTERM to weaver serve", flush=True)
    cycle.exit_code, survivors = lives.stop()
    cycle.stopped_at_s = time.monotonic() - start
    left = {"at_s": cycle.at_s, **lives.ledger.left(lives.rpc_base, survivors)}
    try:
        lives.start()
    except (RuntimeError, TimeoutError) as exc:
        cycle.error = str(exc)[-2000:]
        print(f"weaver serve did not come back: {exc}", flush=True)
        return cycle, left
    cycle.back_at_s = time.monotonic() - start
    print(f"[{cycle.back_at_s:6.0f} s] weaver serve back after "
          f"{cycle.back_at_s - cycle.at_s:.0f} s (stopped with exit code {cycle.exit_code})",
          flush=True)
    return cycle, left
