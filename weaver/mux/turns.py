"""Whose step runs next in a colocated group: MuxServe's ADBS scheduling rule.

MuxServe (§4.2, Algorithm "ADBS") runs prefill jobs first and shares what is left among the
decode jobs of the colocated LLMs round-robin, weighted so that a popular LLM is not
starved by an unpopular one. Weaver applies that rule to engine steps: each engine of a
group asks for a turn before each step, saying whether the step holds prefill tokens, and
the rule below decides which asker goes. Exactly (all state is what the group's table
holds; weaver/mux/table.py):

1. *Who may go at all.* With nobody running, every waiter. With one step running, in
   ``spatial-temporal`` mode only a waiter of another model whose step is of the other kind
   (a prefill beside a decode, MuxServe's spatial split); in ``temporal`` mode nobody. Two
   running steps admit nobody.
2. *Nobody waits forever.* Each time a turn goes to someone else while a member waits, its
   ``skips`` grows by one; a member whose skips reach ``skip_limit`` goes first (the most
   skipped, then the longest waiting). Prefill priority alone could starve a decode for as
   long as prompts keep arriving.
3. *Prefill first*, then decode; within a kind the member with the least service per unit
   of weight (``served_s / weight``; weight: the model's request rate) goes, so over time
   each model's share of the devices follows its load (MuxServe's weighted round-robin).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Rule 2's bound unless a group sets its own (the deployment file's default is the same;
# weaver/config sits below this layer, tests/config/test_deployment.py pins the two equal).
DEFAULT_SKIP_LIMIT = 4


class Mode(str, Enum):
    TEMPORAL = "temporal"  # one step of one model at a time (Mux-Temporal)
    SPATIAL_TEMPORAL = "spatial-temporal"  # a prefill may run beside another model's decode


class Kind(str, Enum):
    DECODE = "decode"
    PREFILL = "prefill"  # the step holds at least one prompt token


@dataclass(frozen=True)
class Member:
    """One engine of the group as the rule sees it."""

    index: int
    weight: float
    served_s: float = 0.0
    waiting: Kind | None = None  # the kind of step it asks for; None: not asking
    running: Kind | None = None  # the kind of step it runs now; None: not running
    skips: int = 0
    wait_since_ns: int = 0

    @property
    def service_per_weight(self) -> float:
        return self.served_s / self.weight


def admissible(members: list[Member], mode: Mode) -> list[Member]:
    """Rule 1: the waiters that could start now beside what runs."""
    running = [m for m in members if m.running is not None]
    waiters = [m for m in members if m.waiting is not None and m.running is None]
    if not running:
        return waiters
    if mode is Mode.TEMPORAL or len(running) > 1:
        return []
    (busy,) = running
    return [m for m in waiters if m.index != busy.index and m.waiting is not busy.running]


def next_turn(members: list[Member], mode: Mode, skip_limit: int) -> int | None:
    """The index of the member whose step starts now, or None (rules 1-3)."""
    candidates = admissible(members, mode)
    if not candidates:
        return None
    overdue = [m for m in candidates if m.skips >= skip_limit]
    if overdue:
        return min(overdue, key=lambda m: (-m.skips, m.wait_since_ns, m.index)).index
    prefills = [m for m in candidates if m.waiting is Kind.PREFILL]
    pool = prefills or candidates
    return min(pool, key=lambda m: (m.service_per_weight, m.wait_since_ns, m.index)).index
