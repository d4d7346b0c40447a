"""Where a new hot sequence's KV lives: local, or remote on the cold device.

A fixed-ratio policy (Weaver §4, "offload ratio") over the sequences *running now*: a new
request goes remote when that keeps the remote share of the running set at or under r,
i.e. when remote + 1 <= r · (running + 1). Counting the running set rather than every
request ever placed keeps the split right whatever finished before (a warm-up request,
an early stop), and spreads remote requests evenly within a burst: r = 0.5 gives L R L R,
r = 2/3 gives L R R L R R. When the chosen pool cannot hold the request and the other can,
it spills there (capacity is the point of weaving), except at the ratio's extremes, which
mean "never" and "always" remote.
"""

from __future__ import annotations

from enum import Enum

_EPSILON = 1e-9  # so that r · n landing exactly on an integer counts as reached


class Placement(str, Enum):
    LOCAL = "L"
    REMOTE = "R"


class RatioPlacement:
    def __init__(self, offload_ratio: float) -> None:
        if not 0.0 <= offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in [0, 1], got {offload_ratio}")
        self.offload_ratio = offload_ratio

    @property
    def may_spill(self) -> bool:
        return 0.0 < self.offload_ratio < 1.0

    def preferred(self, num_running_local: int, num_running_remote: int) -> Placement:
        """Where the next request should go, given the requests running now."""
        num_running = num_running_local + num_running_remote
        is_remote = num_running_remote + 1 <= self.offload_ratio * (num_running + 1) + _EPSILON
        return Placement.REMOTE if is_remote else Placement.LOCAL
