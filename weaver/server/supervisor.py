"""Keep each model's engine running: probe it, and restart it when it dies or hangs.

A single `weaver serve` has no orchestrator above it (vLLM's production stack leaves this to
Kubernetes), so the gateway does it per engine: a probe every `probe_interval_s` (the
engine's own dead flag, its processes, and a utility call answered by the EngineCore between
steps, so a hung core fails it); a dead engine is restarted at once, one whose probes keep
failing for `unhealthy_after_s` is restarted as hung. Restarts wait an exponential back-off
and stop after `max_restarts` within `window_s` (a crash loop), with the reason logged.
While an engine is down its model answers 503 with Retry-After (weaver.server.gateway); once
it is back, `on_restarted` waits for its weaving pairs to link again (weaver.server.weaving).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from weaver.config.serving import RestartPolicy
from weaver.processes import is_process_alive
from weaver.vllm_ext.engine.leftovers import release_closed_engine_memory

logger = logging.getLogger(__name__)

# A probe that gets no answer in this long counts as failed (the hang timer runs on).
PROBE_TIMEOUT_S = 10.0

EngineOpener = Callable[[contextlib.AsyncExitStack], Awaitable[Any]]


class EngineState(str, Enum):
    OK = "ok"
    RESTARTING = "restarting"
    FAILED = "failed"  # crash loop: past the restart cap, down until weaver serve restarts
    STOPPED = "stopped"


class SupervisedEngine:
    """One model's engine (weaver.vllm_ext.engine.app.EngineHandle) that outlives the
    processes behind it: the gateway and the weaving layer hold this object, and every
    attribute they read (app, client, is_dead, ...) is the current engine's."""

    def __init__(self, name: str, open_engine: EngineOpener, policy: RestartPolicy,
                 on_restarted: Callable[[str], Awaitable[None]] | None = None,
                 on_restart: Callable[[str, str], None] | None = None) -> None:
        self.name = name
        self.policy = policy
        self.state = EngineState.STOPPED
        self.num_restarts = 0
        self.last_restart_reason: str | None = None
        self.on_restarted = on_restarted  # set after start-up by the weaving feature
        self._open_engine = open_engine
        self._on_restart = on_restart  # (model, reason), for the restart counter
        self._handle: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._recent_restarts: deque[float] = deque()
        self._watcher: asyncio.Task | None = None

    # --- what the gateway reads (ModelBackend) ---------------------------------------
    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise RuntimeError(f"the engine of {self.name!r} is not running")
        return self._handle

    @property
    def app(self) -> Any:
        return self.handle.app

    @property
    def client(self) -> Any:
        return self.handle.client

    @property
    def spec(self) -> Any:
        return self.handle.spec

    @property
    def is_dead(self) -> bool:
        return self.state is not EngineState.OK or self._handle is None or self._handle.is_dead

    @property
    def is_recovering(self) -> bool:
        """Down, but coming back: worth a retry (503 with Retry-After)."""
        return self.state is EngineState.RESTARTING or (
            self.state is EngineState.OK and self.policy.enabled and self.is_dead)

    async def check_health(self) -> None:
        await self.handle.check_health()

    def scheduler_stats(self) -> dict[str, float]:
        return self._handle.scheduler_stats() if self._handle is not None else {}

    def describe(self) -> dict[str, Any]:
        described = self._handle.describe() if self._handle is not None else {}
        return {**described, "state": self.state.value, "restarts": self.num_restarts,
                "last_restart_reason": self.last_restart_reason}

    # --- lifetime ----------------------------------------------------------------------
    async def start(self) -> None:
        """The first start; a failure propagates (start-up fails as a whole)."""
        self._stack = contextlib.AsyncExitStack()
        try:
            self._handle = await self._open_engine(self._stack)
        except BaseException:
            await self._stack.aclose()
            raise
        self.state = EngineState.OK

    def watch(self) -> None:
        if self.policy.enabled and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name=f"watch {self.name}")

    async def stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def close(self) -> None:
        await self.stop_watching()
        self.state = EngineState.STOPPED
        await self._close_engine()

    async def _close_engine(self) -> None:
        stack, self._stack = self._stack, None
        self._handle = None
        if stack is not None:
            await stack.aclose()

    # --- supervision -------------------------------------------------------------------
    async def _watch(self) -> None:
        failing_since: float | None = None
        while True:
            await asyncio.sleep(self.policy.probe_interval_s)
            if self.state is not EngineState.OK:
                return
            problem, is_fatal = await self._probe()
            if problem is None:
                failing_since = None
                continue
            now = time.monotonic()
            failing_since = failing_since if failing_since is not None else now
            if is_fatal:
                await self._restart(problem)
            elif now - failing_since >= self.policy.unhealthy_after_s:
                await self._restart(f"hung: {problem} for {now - failing_since:.0f} s")
            else:
                continue
            failing_since = None

    async def _probe(self) -> tuple[str | None, bool]:
        """(what is wrong, whether it is certainly dead), or (None, False) when healthy."""
        handle = self._handle
        if handle.is_dead:
            return f"engine died ({handle.client.dead_error!r})", True
        gone = [pid for pid in handle.process_ids if not is_process_alive(pid)]
        if gone:
            return f"engine process(es) {gone} exited", True
        try:
            # Answered by the EngineCore between two steps: a hung core never answers.
            await asyncio.wait_for(handle.client.is_sleeping(),
                                   min(PROBE_TIMEOUT_S, self.policy.unhealthy_after_s))
        except Exception as exc:  # any failure of the probe is a failed probe
            if handle.is_dead:
                return f"engine died ({handle.client.dead_error!r})", True
            return f"health probe failed ({exc!r})", False
        return None, False

    async def _restart(self, reason: str) -> None:
        """Restart until an engine is up, or the crash-loop cap is reached."""
        self.state = EngineState.RESTARTING
        while True:
            now = time.monotonic()
            while self._recent_restarts and now - self._recent_restarts[0] > self.policy.window_s:
                self._recent_restarts.popleft()
            if len(self._recent_restarts) >= self.policy.max_restarts:
                self.state = EngineState.FAILED
                logger.error(
                    "engine %s is down (%s) and has been restarted %d times in the last %.0f s "
                    "(serving.restart.max_restarts): not restarting it again. Its model "
                    "answers 503 until weaver serve is restarted; see the engine's log above "
                    "for why it keeps failing", self.name, reason, len(self._recent_restarts),
                    self.policy.window_s)
                await self._close_engine()
                return
            self._recent_restarts.append(now)
            self.num_restarts += 1
            self.last_restart_reason = reason
            if self._on_restart is not None:
                self._on_restart(self.name, reason)
            delay = self.policy.backoff_for(len(self._recent_restarts))
            logger.warning("engine %s: %s; restarting it in %.1f s (restart %d)", self.name,
                           reason, delay, self.num_restarts)
            await self._close_engine()
            await asyncio.sleep(delay)
            self._stack = contextlib.AsyncExitStack()
            try:
                self._handle = await self._open_engine(self._stack)
            except Exception as exc:  # a failed start is one more restart of the series
                logger.exception("engine %s failed to start again", self.name)
                reason = f"restart failed ({exc!r})"
                continue
            break
        if self.on_restarted is not None:
            try:
                await self.on_restarted(self.name)
            except Exception:  # the model serves; its weaving pair stays degraded
                logger.exception("engine %s restarted, but reconnecting its weaving pairs "
                                 "failed", self.name)
        self.state = EngineState.OK
        logger.info("engine %s is back in service (restart %d)", self.name, self.num_restarts)
        # The old engine's requests have failed by now and let go of its client: free the
        # cycles it sits in (its ZeroMQ threads and sockets with it).
        release_closed_engine_memory()
