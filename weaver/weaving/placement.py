"""Where a new hot sequence's KV lives: local, or remote on the cold device.

A fixed-ratio policy (Weaver §4, "offload ratio"): the k-th placed request goes remote
when floor((k+1)·r) > floor(k·r), which spreads remote requests evenly and places exactly
round(n·r) of any n consecutive ones remote. When the chosen pool cannot hold the request
and the other can, it spills there (capacity is the point of weaving), except at the
ratio's extremes, which mean "never" and "always" remote.
"""

from __future__ import annotations

import math
from enum import Enum


class Placement(str, Enum):
    LOCAL = "L"
    REMOTE = "R"


class RatioPlacement:
    def __init__(self, offload_ratio: float) -> None:
        if not 0.0 <= offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in [0, 1], got {offload_ratio}")
        self.offload_ratio = offload_ratio
        self.num_placed = 0

    @property
    def may_spill(self) -> bool:
        return 0.0 < self.offload_ratio < 1.0

    def preferred(self) -> Placement:
        """Where the next request should go; only `commit` advances the sequence."""
        k, r = self.num_placed, self.offload_ratio
        is_remote = math.floor((k + 1) * r) > math.floor(k * r)
        return Placement.REMOTE if is_remote else Placement.LOCAL

    def commit(self) -> None:
        self.num_placed += 1
