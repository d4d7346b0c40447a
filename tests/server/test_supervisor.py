"""Engine supervision: what is restarted, when, and when it stops trying.

The engines are stand-ins (named as such) with what the supervisor reads of vLLM's
AsyncLLM: `errored`/`dead_error`, `is_sleeping()` (a utility call answered by the
EngineCore between steps) and the engine's process ids. Real engines killed under load are
in test_serve_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from weaver.config.serving import RestartPolicy
from weaver.server.supervisor import EngineState, SupervisedEngine

FAST = RestartPolicy(probe_interval_s=0.01, unhealthy_after_s=0.1, backoff_s=0.01,
                     backoff_max_s=0.04, max_restarts=3, window_s=60)


class StandInClient:
    def __init__(self) -> None:
        self.errored = False
        self.dead_error = RuntimeError("EngineCore died")
        self.hangs = False

    async def is_sleeping(self) -> bool:
        if self.hangs:
            await asyncio.sleep(3600)
        return False


class StandInHandle:
    """What open_engine returns, for one generation of the engine."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.client = StandInClient()
        self.process_ids = [os.getpid()]
        self.app = f"app of generation {generation}"
        self.closed = False

    @property
    def is_dead(self) -> bool:
        return self.client.errored

    def describe(self) -> dict:
        return {"generation": self.generation}


class StandInLauncher:
    def __init__(self, failures_after_first: int = 0) -> None:
        self.handles: list[StandInHandle] = []
        self.failures_left = failures_after_first

    async def open(self, stack: contextlib.AsyncExitStack) -> StandInHandle:
        if self.handles and self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("no memory for the engine")
        handle = StandInHandle(len(self.handles))
        stack.callback(setattr, handle, "closed", True)
        self.handles.append(handle)
        return handle


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def supervised(launcher: StandInLauncher, policy: RestartPolicy = FAST
               ) -> tuple[SupervisedEngine, list[str], list[tuple[str, str]]]:
    reconnected: list[str] = []
    restarts: list[tuple[str, str]] = []

    async def reconnect(name: str) -> None:
        reconnected.append(name)

    engine = SupervisedEngine("m", launcher.open, policy, on_restarted=reconnect,
                              on_restart=lambda model, reason: restarts.append((model, reason)))
    return engine, reconnected, restarts


def test_a_dead_engine_is_restarted_and_its_pairs_reconnected():
    async def go():
        launcher = StandInLauncher()
        engine, reconnected, restarts = supervised(launcher)
        await engine.start()
        engine.watch()
        first = launcher.handles[0]
        first.client.errored = True
        assert engine.is_dead and engine.is_recovering  # 503 with Retry-After meanwhile
        await until(lambda: engine.state is EngineState.OK and len(launcher.handles) == 2)
        assert first.closed and engine.app == "app of generation 1" and not engine.is_dead
        assert reconnected == ["m"]
        assert [model for model, _ in restarts] == ["m"] and "died" in restarts[0][1]
        assert engine.describe()["restarts"] == 1
        await engine.close()
        assert launcher.handles[1].closed and engine.state is EngineState.STOPPED
    asyncio.run(go())


def test_an_engine_whose_process_exited_is_restarted():
    async def go():
        launcher = StandInLauncher()
        engine, _, restarts = supervised(launcher)
        await engine.start()
        launcher.handles[0].process_ids = [2 ** 22 + 12345]  # no such process
        engine.watch()
        await until(lambda: len(restarts) == 1)
        assert "exited" in restarts[0][1]
        await engine.close()
    asyncio.run(go())


def test_a_hung_engine_is_restarted_only_after_unhealthy_after_s():
    async def go():
        launcher = StandInLauncher()
        engine, _, restarts = supervised(launcher)
        await engine.start()
        launcher.handles[0].client.hangs = True
        engine.watch()
        await asyncio.sleep(FAST.unhealthy_after_s / 2)
        assert restarts == [] and engine.state is EngineState.OK
        await until(lambda: len(restarts) == 1)
        assert restarts[0][1].startswith("hung")
        await until(lambda: engine.state is EngineState.OK)
        await engine.close()
    asyncio.run(go())


def test_a_crash_loop_stops_at_the_cap_and_stays_down():
    async def go():
        launcher = StandInLauncher(failures_after_first=100)
        engine, reconnected, restarts = supervised(launcher)
        await engine.start()
        engine.watch()
        launcher.handles[0].client.errored = True
        await until(lambda: engine.state is EngineState.FAILED)
        assert len(restarts) == FAST.max_restarts
        assert "restart failed" in restarts[-1][1]
        assert engine.is_dead and not engine.is_recovering  # 503 without Retry-After
        assert reconnected == []
        await engine.close()
    asyncio.run(go())


def test_no_restart_when_supervision_is_off():
    async def go():
        launcher = StandInLauncher()
        engine, _, restarts = supervised(launcher, RestartPolicy(enabled=False))
        await engine.start()
        engine.watch()
        launcher.handles[0].client.errored = True
        await asyncio.sleep(0.05)
        assert restarts == [] and engine.is_dead and not engine.is_recovering
        await engine.close()
    asyncio.run(go())


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff_s=1, backoff_max_s=5)
    assert [policy.backoff_for(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
