"""How much the offloaded tasks slow a cold model down, measured on the cold side.

The cold model's TPOT grows by what its steps spend on the hot model's tasks: tasks
served at poll points inside a step, and the wait of a step that found the idle poller
serving a task (both hold the step lock). `StepMeter` stands in for the step lock around
the cold worker's steps (patches/worker_step_lock.py) and times them; `inflation` turns
its totals into the factor the cold TPOT is at over what it would be without the tasks:

    (own compute + task time in steps + lock waits) / own compute

over the last `WINDOW_S`. An idle cold model has no TPOT to hurt: 1.0. The hot side reads
the factor from the region header (layout.COLD_INFLATION_OFFSET), and its adaptive
placement holds it to the cold model's budget (weaver/weaving/placement.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 5.0  # the span the factor is measured over: ~50 cold steps on this CPU
MIN_BUSY_SHARE = 0.05  # a cold model stepping less than this share of the window is idle


class StepMeter:
    """The cold worker's step lock (a context manager), timing the steps it guards: time
    held, and time waited for it (the idle poller was serving a task)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._entered_at = 0.0
        self.held_s = 0.0
        self.waited_s = 0.0

    def __enter__(self) -> StepMeter:
        start = time.monotonic()
        self._lock.acquire()
        self._entered_at = time.monotonic()
        self.waited_s += self._entered_at - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.held_s += time.monotonic() - self._entered_at
        self._lock.release()


class ColdInflation:
    """The factor over a sliding window, from cumulative totals sampled now and then."""

    def __init__(self, meter: StepMeter, task_s_in_steps: Callable[[], float],
                 window_s: float = WINDOW_S) -> None:
        self.meter = meter
        self.task_s_in_steps = task_s_in_steps  # tasks served at poll points, in total
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float, float]] = deque()

    def sample(self, now: float | None = None) -> float:
        """Record the totals now; the factor over the window that ends now."""
        now = time.monotonic() if now is None else now
        current = (now, self.meter.held_s, self.meter.waited_s, self.task_s_in_steps())
        self._samples.append(current)
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        return factor(self._samples[0], current)


def factor(old: tuple[float, float, float, float], new: tuple[float, float, float, float]
           ) -> float:
    """The cold TPOT factor between two samples (time, held, waited, task time)."""
    span = new[0] - old[0]
    held, waited, tasks = (n - o for n, o in zip(new[1:], old[1:], strict=True))
    own = held - tasks
    if span <= 0 or held + waited < MIN_BUSY_SHARE * span or own <= 0:
        return 1.0
    return (held + waited) / own
