"""The requests the gateway has handed to engines: counted per model (back-pressure), each
bounded by its deadline, and abortable all at once (the end of a graceful drain).

A forwarded request runs in its own task; aborting it cancels that task, which vLLM's
serving code turns into an abort of the request in its engine (AsyncLLM.generate aborts on
CancelledError), so its KV blocks are freed at once. What the client is told is the
gateway's business (weaver.server.gateway), from `Aborted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Aborted:
    """Why a forwarded request was cut short, and the HTTP status that says so."""

    status: int
    message: str


@dataclass(eq=False)
class _Forwarded:
    model: str
    task: asyncio.Task
    aborted: Aborted | None = None


@dataclass
class InFlight:
    _requests: set[_Forwarded] = field(default_factory=set)
    _per_model: Counter[str] = field(default_factory=Counter)
    _idle: asyncio.Event | None = None

    def count(self, model: str) -> int:
        return self._per_model[model]

    @property
    def total(self) -> int:
        return len(self._requests)

    async def run(self, model: str, call: Awaitable[None], timeout_s: float | None
                  ) -> Aborted | None:
        """Run one forwarded request to its end; what cut it short, or None."""
        forwarded = _Forwarded(model, asyncio.ensure_future(call))
        self._requests.add(forwarded)
        self._per_model[model] += 1
        try:
            done, _ = await asyncio.wait({forwarded.task}, timeout=timeout_s)
            if not done:
                forwarded.aborted = Aborted(
                    504, f"the request ran past its deadline of {timeout_s:g} s and was "
                    "aborted; raise the model's timeout_s or the X-Request-Timeout header")
                forwarded.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forwarded.task
            return forwarded.aborted
        finally:
            # Also when the connection's own task is cancelled (the server forced down).
            if not forwarded.task.done():
                forwarded.task.cancel()
            self._requests.discard(forwarded)
            self._per_model[model] -= 1
            if not self._requests and self._idle is not None:
                self._idle.set()

    def abort_all(self, aborted: Aborted) -> int:
        """Cut every forwarded request short; how many there were."""
        for forwarded in list(self._requests):
            forwarded.aborted = aborted
            forwarded.task.cancel()
        return len(self._requests)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight, False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._requests:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                return not self._requests
        return True
