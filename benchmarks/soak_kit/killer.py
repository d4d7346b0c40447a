"""The soak's engine kills: SIGKILL to one process of one engine at a time, at planned times,
each role in turn (engines.kill_order); the gateway's supervisor restarts the engine
(weaver/server/supervisor.py) and a kill counts as recovered when /health shows the
engine in service with one more restart.

A kill and its recovery hold `lock`, which a whole-server restart takes too: a restart never
lands in the middle of a recovery (the new server would count restarts from zero), and a
kill due while the server is down waits for it to be back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import psutil

from benchmarks.soak_kit.engines import Role, engines_of, in_service

RECOVERY_LIMIT_S = 300.0  # past it the kill stays unrecovered (the verdict then fails)
IN_SERVICE_LIMIT_S = 300.0  # a victim not in service this long is skipped
POLL_S = 1.0


@dataclass
class Kill:
    at_s: float  # since the load started
    model: str  # the engine's name in the deployment
    process: str  # "engine core" or "worker"
    pid: int
    restarts_before: int = 0  # the engine's restarts in /health when it was killed
    back_at_s: float | None = None  # when /health said the engine was in service again

    @property
    def recovery_s(self) -> float | None:
        return None if self.back_at_s is None else self.back_at_s - self.at_s

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "recovery_s": self.recovery_s}


def health_of(base_url: str | None) -> dict[str, Any] | None:
    if base_url is None:
        return None
    try:
        return httpx.get(f"{base_url}/health", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return None


def engine_process(engine: dict[str, Any], kind: str) -> psutil.Process | None:
    """The engine's EngineCore (its first pid), or the worker it started (vLLM titles it
    VLLM::Worker; else its first child)."""
    core = psutil.Process(engine["engine_pids"][0])
    if kind == "engine core":
        return core
    children = core.children()
    titled = [c for c in children if "Worker" in " ".join(c.cmdline()) + c.name()]
    return (titled or children or [None])[0]


class Killer(threading.Thread):
    """Kills the planned roles at the planned times (seconds since `start`), one at a time:
    each waits for the last victim to be back in service."""

    def __init__(self, base_url: Callable[[], str | None], plan: list[tuple[float, Role]],
                 start: float, lock: threading.Lock) -> None:
        super().__init__(daemon=True, name="soak-killer")
        self.base_url, self.plan, self.start_at, self.lock = base_url, plan, start, lock
        self.kills: list[Kill] = []
        self.skipped: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.start_at

    def run(self) -> None:
        for planned_s, role in self.plan:
            if self.stop.wait(max(planned_s - self.now(), 0)):
                return
            while not self.lock.acquire(timeout=POLL_S):
                if self.stop.is_set():
                    return
            try:
                kill = self._kill(role)
                if kill is not None:
                    self._await_back(kill)
            finally:
                self.lock.release()

    def _kill(self, role: Role) -> Kill | None:
        engine_name, kind = role
        deadline = time.monotonic() + IN_SERVICE_LIMIT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            health = health_of(self.base_url())
            if health is not None and engine_name in in_service(health):
                # The engine may die or restart between /health and the kill: look again.
                with contextlib.suppress(psutil.Error, KeyError, IndexError):
                    victim = engine_process(engines_of(health)[engine_name], kind)
                    if victim is not None:
                        restarts_before = in_service(health)[engine_name]
                        victim.kill()
                        return self._killed(engine_name, kind, victim.pid, restarts_before)
            self.stop.wait(POLL_S)
        self.skipped.append({"at_s": self.now(), "model": engine_name, "process": kind})
        print(f"[{self.now():6.0f} s] skipped the {kind} of {engine_name}: not in service",
              flush=True)
        return None

    def _killed(self, engine_name: str, kind: str, pid: int, restarts_before: int) -> Kill:
        kill = Kill(self.now(), engine_name, kind, pid, restarts_before)
        self.kills.append(kill)
        print(f"[{kill.at_s:6.0f} s] killed the {kind} of {engine_name} (pid {pid})",
              flush=True)
        return kill

    def _await_back(self, kill: Kill) -> None:
        deadline = time.monotonic() + RECOVERY_LIMIT_S
        while not self.stop.wait(POLL_S) and time.monotonic() < deadline:
            if self.is_back(kill):
                return

    def is_back(self, kill: Kill) -> bool:
        """Marks the kill recovered when its engine is in service with a new restart."""
        health = health_of(self.base_url())
        restarts = None if health is None else in_service(health).get(kill.model)
        if restarts is not None and restarts > kill.restarts_before:
            kill.back_at_s = self.now()
            print(f"[{kill.back_at_s:6.0f} s] {kill.model} back after {kill.recovery_s:.1f} s",
                  flush=True)
            return True
        return False


def kill_plan(duration_s: float, roles: list[Role], rng) -> list[tuple[float, Role]]:
    """Evenly spaced slots, a random instant in each, none in the last 10 %: a kill is worth
    measuring only if its recovery falls inside the load."""
    if not roles:
        return []
    slot = 0.9 * duration_s / len(roles)
    return [(i * slot + rng.uniform(0.1, 0.9) * slot, role) for i, role in enumerate(roles)]
