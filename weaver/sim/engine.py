"""Discrete-event core: events ordered by (time, id); an event's action returns follow-ups.

Ids come from one counter per engine, so two events at the same instant run in the order
they were created and a run is deterministic for a given seed (as in SplitwiseSim/vidur,
whose events also return the events they cause).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Action = Callable[[float], "Iterable[Event] | None"]


@dataclass
class Event:
    time: float
    event_id: int
    name: str
    action: Action = field(repr=False)


class Engine:
    def __init__(self) -> None:
        # (time, id, event) tuples: compared in C, and ids are unique so events never are.
        self._queue: list[tuple[float, int, Event]] = []
        self._ids = itertools.count()
        self.now = 0.0
        self.num_processed = 0

    def event(self, time: float, name: str, action: Action) -> Event:
        """Make an event (not yet queued); its id fixes its order among equal times."""
        if time < self.now:
            raise ValueError(f"event {name!r} at {time} is before now ({self.now})")
        return Event(time, next(self._ids), name, action)

    def schedule(self, time: float, name: str, action: Action) -> Event:
        ev = self.event(time, name, action)
        heapq.heappush(self._queue, (ev.time, ev.event_id, ev))
        return ev

    def push(self, events: Iterable[Event] | None) -> None:
        for ev in events or ():
            heapq.heappush(self._queue, (ev.time, ev.event_id, ev))

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    def run(self, until: float = float("inf"), on_event: Callable[[Event], None] | None = None
            ) -> float:
        """Process events in (time, id) order up to `until`; returns the final time."""
        while self._queue and self._queue[0][0] <= until:
            ev = heapq.heappop(self._queue)[2]
            self.now = ev.time
            self.push(ev.action(ev.time))
            self.num_processed += 1
            if on_event is not None:
                on_event(ev)
        return self.now
