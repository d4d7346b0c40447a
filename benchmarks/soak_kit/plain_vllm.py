"""The soak's plain `vllm serve` phase: one engine of each kind Weaver's plugin supports
without Weaver's gateway (docs/weaving.md, "Weaving under plain `vllm serve`";
docs/colocation.md): a weaving pair's hot and cold servers, and two members of a mux
group. Each is started (Weaver's plugin loads in it: weaver/bench/server_process.py
`vllm_server`), given a little load, SIGTERMed and started again, the cold one also
SIGKILLed (front end, EngineCore and worker at once, as a crash) while the hot one serves;
in the end every server gets SIGTERM, and /dev/shm must hold no file it did not hold before
the phase, and the socket base no socket file.

The servers run as a user's would: vLLM's default --shutdown-timeout (0: SIGTERM kills the
worker before it unlinks anything), the default runtime directories
(/dev/shm/weaver-pairs-<uid>, /dev/shm/weaver-mux-<uid>), one socket base for all of them
(as one machine's /tmp; a directory of the phase's own here, so that only its servers'
files are counted), and nothing the harness unlinks for them (weaver/bench/server_process.py
`as_deployed`). The pair's and the group's names carry this process's pid, so two runs do
not meet.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.soak_kit.outcomes import OUTCOMES
from benchmarks.soak_kit.watch import ShmLedger
from weaver.bench.server_process import (
    RPC_BASE_PATH_ENV,
    RunningServer,
    vllm_cli_env,
    vllm_server,
)

MiB = 1 << 20
REQUESTS_EACH = 4  # "a little load": per server, per round
MAX_TOKENS = 16
CONNECT_LIMIT_S = 120.0
STOP_TIMEOUT_S = 60.0
COMMON_ARGS = ("--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
               "--block-size", "32", "--max-num-seqs", "16",
               "--kv-cache-memory-bytes", str(50 * MiB))


@dataclass(frozen=True)
class PlainEngine:
    name: str  # its --served-model-name
    model: str  # a prepared model (weaver/models/registry.py)
    cores: str  # VLLM_CPU_OMP_THREADS_BIND
    block: dict[str, Any]  # its `weaver` block

    def args(self) -> list[str]:
        return ["--served-model-name", self.name, *COMMON_ARGS,
                "--additional-config", json.dumps({"weaver": self.block})]


def plain_engines(tag: str) -> list[PlainEngine]:
    pair, group = f"soak{tag}", f"soak{tag}-mux"
    members = {"mux-a": 1.0, "mux-b": 1.0}
    return [
        PlainEngine("hot", "tiny-llama-a", "0", {"role": "hot", "pair": pair,
                                                 "remote_kv_gib": 0.03, "offload_ratio": 0.5,
                                                 "timeout_s": 10.0}),
        PlainEngine("cold", "tiny-llama-b", "1", {"role": "cold", "pair": pair,
                                                  "lend_kv_gib": 0.05}),
        *(PlainEngine(m, "tiny-llama-a", "0-1", {"mux": {
            "group": group, "member": m, "members": members, "mode": "spatial-temporal"}})
          for m in members),
    ]


@dataclass
class PlainServer:
    engine: PlainEngine
    log_path: Path
    env: dict[str, str]
    server: RunningServer | None = None
    starts: int = 0
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def start(self) -> None:
        from weaver.models.registry import prepare_model

        stack = contextlib.ExitStack()
        self.server = stack.enter_context(vllm_server(
            str(prepare_model(self.engine.model)), self.log_path, *self.engine.args(),
            env_overrides={**self.env, "VLLM_CPU_OMP_THREADS_BIND": self.engine.cores},
            as_deployed=True))
        self._stack, self.starts = stack, self.starts + 1

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """SIGTERM to the front end (or SIGKILL to every process, a crash); returns how many
        of its processes outlived it."""
        server, self.server = self.server, None
        if server is None:
            return 0
        children = server.descendants()
        if sig == signal.SIGKILL:
            for victim in [*children, psutil.Process(server.process.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.kill()
        with contextlib.suppress(Exception):
            server.stop(signal.SIGTERM, timeout_s=STOP_TIMEOUT_S)
        _, survivors = psutil.wait_procs(children, timeout=30)
        self._stack.close()
        return len(survivors)


def complete(server: RunningServer, model: str, num: int) -> list[str]:
    """`num` completions at once; each one's outcome (ok, clean: an HTTP error with an
    OpenAI body; lost: anything else). vLLM's own answers carry no Retry-After."""
    def one(i: int) -> str:
        try:
            reply = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
                "model": model, "prompt": f"Soak request {i}:" + " more" * 40,
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
        except httpx.HTTPError:
            return "lost"
        if reply.status_code == 200:
            return "ok"
        return "clean" if '"error"' in reply.text or "'error'" in reply.text else "lost"

    with cf.ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def pair_connected(hot: RunningServer) -> bool:
    """Waits until the hot server's pair is linked; it links on its scheduler's steps, so
    a one-token request goes in now and then."""
    deadline = time.monotonic() + CONNECT_LIMIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            metrics = httpx.get(f"{hot.base_url}/metrics", timeout=30).text
            if any(line.startswith("weaver_pair_connected") and float(line.split()[-1]) >= 1
                   for line in metrics.splitlines()):
                return True
            httpx.post(f"{hot.base_url}/v1/completions", timeout=60,
                       json={"model": "hot", "prompt": "Hi", "max_tokens": 1})
        time.sleep(1.5)  # the pair's counters are published every second
    return False


class PlainPhase:
    """Runs the phase; `result()` is what soak.json keeps of it."""

    def __init__(self, work_dir: Path, log_dir: Path) -> None:
        self.ledger = ShmLedger()
        self.rpc_base = work_dir / "rpc"
        self.rpc_base.mkdir()
        env = {**vllm_cli_env(work_dir / "shim"), RPC_BASE_PATH_ENV: str(self.rpc_base)}
        self.servers = {e.name: PlainServer(e, log_dir / f"vllm-{e.name}.serve.log", env)
                        for e in plain_engines(str(os.getpid()))}
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.steps: list[dict[str, Any]] = []
        self.not_back: list[str] = []
        self.survivors = 0
        self.started = time.monotonic()

    def run(self) -> dict[str, Any]:
        try:
            for server in self.servers.values():
                server.start()
            self._check_pair("started")
            self._load(list(self.servers), "started")
            for name in self.servers:
                self._cycle(name, signal.SIGTERM)
            self._crash_cold_under_load()
        except (RuntimeError, TimeoutError) as exc:  # a server that did not start
            self.not_back.append(f"a server did not start: {str(exc)[-500:]}")
        finally:
            for server in self.servers.values():
                self.survivors += server.stop(signal.SIGTERM)
        return self.result()

    def result(self) -> dict[str, Any]:
        left = self.ledger.left(self.rpc_base, self.survivors)
        removed = self.ledger.clean_up()
        return {"outcomes": self.outcomes, "steps": self.steps, "not_back": self.not_back,
                "left_after_stop": left, "removed_after_counting": removed,
                "seconds": time.monotonic() - self.started}

    def _cycle(self, name: str, sig: int) -> None:
        self.survivors += self.servers[name].stop(sig)
        self.servers[name].start()
        self._check_pair(f"{name} restarted")
        self._load([name, *(["hot"] if name == "cold" else [])], f"{name} restarted")

    def _crash_cold_under_load(self) -> None:
        """The cold server SIGKILLed while the hot one serves: the hot one's remote
        sequences fall back to its own side; a new cold server is linked again."""
        hot = self.servers["hot"].server
        assert hot is not None
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(complete, hot, "hot", 2 * REQUESTS_EACH)
            time.sleep(1.0)
            self.survivors += self.servers["cold"].stop(signal.SIGKILL)
            self._count("cold SIGKILLed, hot under load", pending.result())
        self.servers["cold"].start()
        self._check_pair("cold started after its crash")
        self._load(["hot", "cold"], "cold started after its crash")

    def _check_pair(self, step: str) -> None:
        hot = self.servers["hot"].server
        if hot is None or not pair_connected(hot):
            self.not_back.append(f"{step}: the hot-cold pair did not link again")

    def _load(self, names: list[str], step: str) -> None:
        for name in names:
            server = self.servers[name].server
            assert server is not None
            self._count(f"{step}: {name}", complete(server, name, REQUESTS_EACH))

    def _count(self, step: str, kinds: list[str]) -> None:
        for kind in kinds:
            self.outcomes[kind] += 1
        self.steps.append({"at_s": time.monotonic() - self.started, "step": step,
                           "outcomes": {k: kinds.count(k) for k in set(kinds)}})
        print(f"plain vllm serve: {step}: {self.steps[-1]['outcomes']}", flush=True)
