"""What a hot engine's scheduler feeds its adaptive placement (`offload_ratio: auto`).

Each step: its wall time from schedule() to the update of its output, its local and
remote sequences, and whether it ran decodes only (weaver/weaving/placement.py
`AdaptivePlacement.observe_step`), then each request it finished and its output tokens
(`sequence_finished`); every `PAIR_LOAD_INTERVAL_S`: its pairs' load (each cold
model's TPOT factor, the offload wait) read from the hot worker, then the policy's
decision, and how many remote sequences each cold over its budget gives back (the caller
preempts them). The scheduler (weaver/vllm_ext/scheduler.py) knows vLLM's objects; this knows
the timing and the policy, so the simulator's and the tests' steps could drive it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from weaver.weaving.placement import AdaptivePlacement, PairLoad

logger = logging.getLogger(__name__)

PAIR_LOAD_INTERVAL_S = 0.5  # how often the pair's load is read and the policy decides

# The policy's report in, each pair's load out, in plan order (None for a pair whose region
# is not attached; None for all before any is): the hot worker's weaver_pair_load, reached
# through vLLM's collective_rpc.
PairLoadReader = Callable[[dict], "list[dict | None] | None"]


class PlacementFeed:
    def __init__(self, placement: AdaptivePlacement, hot: str, verbose: bool = True) -> None:
        self.placement = placement
        self.hot = hot
        # Step-asides log as warnings, the order's flips and the cap's cuts as info; not
        # verbose, both at debug (the simulator runs thousands of decisions).
        self.verbose = verbose
        self.read_pair_load: PairLoadReader | None = None  # set once the engine is up
        self._step_started: float | None = None
        self._next_load = 0.0

    def step_starts(self, now: float | None = None,
                    num_running_on: list[int] | None = None) -> list[int]:
        """Before a step: every PAIR_LOAD_INTERVAL_S, the pairs' load and the policy's
        decision. Returns how many remote sequences to preempt on each cold (plan order;
        `num_running_on`: how many run on each now; none given, nothing to shed)."""
        now = time.monotonic() if now is None else now
        shed = [0] * len(num_running_on or ())
        if now >= self._next_load:
            self._next_load = now + PAIR_LOAD_INTERVAL_S
            self._read_pair_load()
            remote_first, cap = self.placement.remote_first, self.placement.remote_cap
            if self.placement.update(now):  # stepped aside or resumed
                (logger.warning if self.verbose else logger.debug)(
                    "weaving %s: %s", self.hot, self.placement.reason)
            elif self.placement.remote_first != remote_first or _was_cut(
                    cap, self.placement.remote_cap):
                # The order's flips and the cap's cuts (not its one-by-one growth, which
                # would log every update under load).
                (logger.info if self.verbose else logger.debug)(
                    "weaving %s: %s", self.hot, self.placement.reason)
            if num_running_on:
                shed = self.placement.shed_for_cold(num_running_on, now)
                for cold, num in enumerate(shed):
                    if num:
                        (logger.info if self.verbose else logger.debug)(
                            "weaving %s: %d remote sequence(s) of cold %d preempted: its "
                            "TPOT is x%.3f its own, over its budget x%.3f", self.hot, num,
                            cold, self.placement.cold_factor(cold),
                            self.placement.targets.cold_budget)
        self._step_started = now
        return shed

    def step_ended(self, num_local: int, num_remote: int, is_decode_only: bool,
                   now: float | None = None) -> None:
        started, self._step_started = self._step_started, None
        if started is None:
            return
        now = time.monotonic() if now is None else now
        self.placement.observe_step(now - started, num_local, num_remote, is_decode_only)

    def sequence_finished(self, num_output_tokens: int) -> None:
        """A hot request finished with the step that just ended (after `step_ended`), with
        that many output tokens: its TPOT, for the policy's tail (placement.py TpotTail)."""
        self.placement.observe_finished(num_output_tokens)

    def _read_pair_load(self) -> None:
        if self.read_pair_load is None:
            return
        try:
            load = self.read_pair_load(self.placement.report())
        except Exception as exc:  # the policy keeps its last view; the step goes on
            logger.warning("weaving %s: the pair's load is unavailable (%r)", self.hot, exc)
            return
        if load is not None:
            self.placement.observe_pair(PairLoad.of_colds(load))


def _was_cut(before: int | None, after: int | None) -> bool:
    return after is not None and (before is None or after < before)
