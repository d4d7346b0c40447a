"""Engines that start together each spawn with their own environment
(weaver/vllm_ext/engine/app.py: the spawn lock is held, and the engine's environment set,
until its build has spawned a process), and a failed start cancels the others
(weaver/server/app.py _start_together). Real spawned processes stand in for vLLM's
EngineCore: a build that sets up for a moment, spawns, then waits for a handshake."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from weaver.server.app import _start_together
from weaver.vllm_ext.engine.app import (
    _engine_environment,
    _in_a_thread_of_its_own,
    _spawned_children,
    _until_spawned,
)

VARIABLE = "WEAVER_TEST_ENGINE_ENV"


def _write_environment(path: str) -> None:  # runs in the spawned child
    Path(path).write_text(os.environ.get(VARIABLE, "unset"))


def _build(out: Path, name: str) -> float:
    """AsyncLLM.from_vllm_config's shape: set-up, the spawn, a long handshake."""
    time.sleep(0.2)
    child = multiprocessing.get_context("spawn").Process(
        target=_write_environment, args=(str(out / name),))
    child.start()
    time.sleep(2.0)  # the EngineCore's start-up, which the other engines overlap
    child.join(30)
    assert child.exitcode == 0
    return time.monotonic()


async def _start(out: Path, name: str, lock: asyncio.Lock) -> tuple[float, float]:
    async with lock:
        with _engine_environment({VARIABLE: name}):
            before = _spawned_children()
            build = asyncio.ensure_future(asyncio.to_thread(_build, out, name))
            await _until_spawned(build, before)
            assert not build.done()  # released while the engine still starts
            released = time.monotonic()
    return released, await build


def test_engines_started_together_spawn_with_their_own_environment(tmp_path):
    async def main():
        lock = asyncio.Lock()
        return await asyncio.gather(*(_start(tmp_path, name, lock) for name in "abc"))

    os.environ.pop(VARIABLE, None)
    times = asyncio.run(main())
    assert {name: (tmp_path / name).read_text() for name in "abc"} == \
        {"a": "a", "b": "b", "c": "c"}
    assert VARIABLE not in os.environ  # restored once each had spawned
    # Side by side: the last one released the lock before the first build ended (an
    # order, not a duration: the suite shares its cores with other tests).
    assert max(released for released, _ in times) < min(built for _, built in times)


def test_more_builds_than_the_default_executor_has_threads_run_side_by_side():
    # asyncio.to_thread's executor has min(32, cores + 4) threads: the builds past those
    # waited for one to end (the barrier then breaks after its timeout).
    num_builds = min(32, (os.cpu_count() or 1) + 4) + 2
    barrier = threading.Barrier(num_builds, timeout=20)

    async def main():
        await asyncio.gather(*(_in_a_thread_of_its_own(barrier.wait)
                               for _ in range(num_builds)))

    asyncio.run(main())
    assert not barrier.broken


class _Engine:
    def __init__(self, fails: bool, delay_s: float) -> None:
        self.fails, self.delay_s = fails, delay_s
        self.cancelled = self.started = False

    async def start(self) -> None:
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fails:
            raise RuntimeError("model 'b': vLLM refused to start")
        self.started = True


def test_a_failed_start_cancels_the_others_and_is_raised_as_it_is():
    engines = [_Engine(False, 5.0), _Engine(True, 0.05), _Engine(False, 0.01)]
    with pytest.raises(RuntimeError, match="model 'b'"):
        asyncio.run(_start_together(engines))
    assert engines[0].cancelled and not engines[0].started
    assert engines[2].started  # it had finished before the failure
