"""What a simulated hot model's adaptive placement (`offload_ratio: auto`) is fed, as the
engine feeds it.

The engine's hot scheduler observes every step, and every `PAIR_LOAD_INTERVAL_S` reads each
cold model's TPOT factor and lets the policy decide (weaver/weaving/placement_feed.py); the
cold side measures that factor over its last `WINDOW_S` of steps (weaver/weaving/
cold_load.py). The simulator drives the same `PlacementFeed` and the same `ColdInflation`
window over the cold device's simulated steps.

Why not simpler: the simulator had decided after every step on the cold factor of the last
hot step alone. A decode-only hot step over many remote contexts read the cold device at
x1.2 while over seconds it ran near x1.1, so the remote cap was cut every
`COLD_CUT_HOLD_S`; each cut restarts the woven steps' TPOT mean, which then never reached
its `min_tpot_samples`, and `auto` held on to weaving whose hot TPOT missed the SLO
(regime map, Llama-2-13B Azure code under the loose SLO: -17 % and -25 % against dedicated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weaver.weaving.cold_load import ColdInflation
from weaver.weaving.placement import AdaptivePlacement
from weaver.weaving.placement_feed import PlacementFeed

if TYPE_CHECKING:
    from weaver.sim.instance import ModelServer


class ColdStepTotals:
    """Stands in for the cold worker's timed step lock (cold_load.StepMeter): the cold
    device's step time in total, and the part of it the offloaded tasks took."""

    def __init__(self) -> None:
        self.held_s = 0.0  # the device's steps, as they ran
        self.waited_s = 0.0  # a simulated step never waits for the idle poller
        # The offloaded attention served within them; the polling costs the step too, but
        # the cold worker counts it as its own (cold_load.py: tasks served at poll points).
        self.task_s = 0.0

    def record(self, step_s: float, task_s: float) -> None:
        """One step of `step_s`, `task_s` of it serving the offloaded tasks."""
        self.held_s += step_s
        self.task_s += task_s


class ColdLoad:
    """A device's TPOT factor as the cold side measures it: over the last `WINDOW_S`."""

    def __init__(self) -> None:
        self.totals = ColdStepTotals()
        self._window = ColdInflation(self.totals, lambda: self.totals.task_s)

    def record(self, step_s: float, task_s: float) -> None:
        self.totals.record(step_s, task_s)

    def factor(self, now: float) -> float:
        return self._window.sample(now)


def adaptive_feed(server: ModelServer, placement: AdaptivePlacement) -> PlacementFeed:
    """The engine's feed over `server`'s colds (read at each decision, in plan order).
    Its decisions log at DEBUG: a sweep runs thousands of them."""
    feed = PlacementFeed(placement, server.name, verbose=False)
    feed.read_pair_load = lambda report: [
        {"cold_inflation": remote.instance.tpot_factor()} for remote in server.remotes]
    return feed
