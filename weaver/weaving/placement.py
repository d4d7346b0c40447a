"""Where a new hot sequence's KV lives: local, or remote on the cold device.

Two policies answer `order(num_running_local, num_running_remote)`: the pools to try, in
turn, for a newly admitted (or preempted and re-admitted) sequence.

- `RatioPlacement` (a fixed `offload_ratio`, Weaver §4): a new request goes remote when
  that keeps the remote share of the running set at or under r, i.e. when
  remote + 1 <= r · (running + 1). Counting the running set rather than every request ever
  placed keeps the split right whatever finished before (a warm-up request, an early stop),
  and spreads remote requests evenly within a burst: r = 0.5 gives L R L R, r = 2/3 gives
  L R R L R R. When the chosen pool cannot hold the request and the other can, it spills
  there (capacity is the point of weaving), except at the ratio's extremes, which mean
  "never" and "always" remote.
- `AdaptivePlacement` (`offload_ratio: auto`): local first, remote when the local pool
  cannot hold the sequence (the batch is capped by KV right now); remote first instead
  when a remote sequence costs the hot step less than a local one (its attention runs on
  the cold device meanwhile). How many sequences may be remote is judged from live
  measurements: the hot steps' mean time against its TPOT target and the cold model's
  TPOT growth against its budget (`PairLoad`). When weaving does not pay (that number
  falls to 0, or more than `TAIL_SHARE` of the sequences that decoded beside remote ones
  ran over the SLO's TPOT: `TpotTail`) it steps aside (no new remote sequences; the
  running ones finish where they are) for a cool-down, then tries again with one, and says
  why (`reason`, `report`); each try in a row that fails with that one doubles the next
  cool-down. A step-time
  model fitted on recent decode steps (`StepTimeModel`) gives what a local and a remote
  sequence each add to the hot step, and how many more tokens per second the woven batch
  serves than its local part.

A hot model weaving into several cold models places a remote sequence on one of them
(`cold_order`): the colds whose side is connected and, under `auto`, whose TPOT is within
its budget, most free lent blocks first. The policy's cap and step-aside then follow the
best cold's factor (with one cold, its own): a cold over its budget takes no new sequences
while another can.

A cold still over its budget a window after it went over also gives sequences back
(`shed_for_cold`): the hot scheduler preempts that many of its newest remote sequences
there, and vLLM recomputes them later where the policy then places them. Without it a cut
acted only as the remote sequences finished, 40-110 s later on this CPU, while the cold ran
over its budget (benchmarks/HISTORY.md, "A cold model hosting two hot ones").

Plain Python: the hot engine's scheduler (weaver/vllm_ext/scheduler.py), the simulator and
the planner use these classes unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from weaver.weaving.tpot_tail import TpotTail

_EPSILON = 1e-9  # so that r · n landing exactly on an integer counts as reached
AUTO = "auto"  # the offload_ratio value that selects AdaptivePlacement
# A planned `auto` pair's hot TPOT target as a share of the SLO's TPOT: the woven steps'
# mean is held under it, which leaves their spread room under the SLO (the KV-bound
# deployments: 170 ms under 200, benchmarks/deployments/kv_bound/weaving_auto.yaml).
SLO_TPOT_SHARE = 0.85


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

    def cold_is_open(self, index: int) -> bool:
        """A fixed ratio places on any connected cold."""
        return True

    def order(self, num_running_local: int, num_running_remote: int) -> list[Placement]:
        preferred = self.preferred(num_running_local, num_running_remote)
        if not self.may_spill:
            return [preferred]
        other = Placement.LOCAL if preferred is Placement.REMOTE else Placement.REMOTE
        return [preferred, other]


@dataclass(frozen=True)
class AdaptiveTargets:
    """What `AdaptivePlacement` holds weaving to."""

    # The hot model's TPOT target (s); None: `hot_budget` x its local-only step time.
    hot_tpot_s: float | None = None
    hot_budget: float = 1.25
    # The cold model's TPOT may grow by at most this factor over its TPOT with no offload.
    cold_budget: float = 1.10
    cooldown_s: float = 20.0  # how long weaving stays aside before it is tried again
    min_samples: int = 8  # decode steps before the step-time model is trusted
    min_tpot_samples: int = 50  # woven steps before their mean is held to the TPOT target

    @classmethod
    def of_pair(cls, hot_tpot_ms: float | None, cold_tpot_budget: float) -> AdaptiveTargets:
        """From a weaving pair's settings (a deployment's `hot_tpot_ms`, `cold_tpot_budget`)."""
        return cls(hot_tpot_s=None if hot_tpot_ms is None else hot_tpot_ms / 1000,
                   cold_budget=cold_tpot_budget)

    def __post_init__(self) -> None:
        if self.hot_tpot_s is not None and not self.hot_tpot_s > 0:
            raise ValueError(f"the hot TPOT target must be > 0 s, got {self.hot_tpot_s}")
        if self.hot_budget < 1 or self.cold_budget < 1:
            raise ValueError("hot_budget and cold_budget are factors >= 1, got "
                             f"{self.hot_budget}, {self.cold_budget}")


@dataclass(frozen=True)
class PairLoad:
    """What the hot worker sees of its pairs (None: not measured yet)."""

    # Cold step time with the tasks / without them: the best cold's (the one most within
    # its budget; with one cold, its own), and each cold's in plan order.
    cold_inflation: float | None = None
    offload_wait_s: float | None = None  # recent mean wait for a remote task
    cold_inflations: tuple[float | None, ...] = ()

    @classmethod
    def of_colds(cls, loads: list[dict[str, float | None] | None]) -> PairLoad:
        """From each cold's load as its pair's hot runtime reads it (None: not attached)."""
        factors = tuple(None if load is None else load.get("cold_inflation")
                        for load in loads)
        known = [factor for factor in factors if factor is not None]
        waits = [load["offload_wait_s"] for load in loads
                 if load is not None and load.get("offload_wait_s") is not None]
        return cls(cold_inflation=min(known) if known else None,
                   offload_wait_s=sum(waits) / len(waits) if waits else None,
                   cold_inflations=factors)


def cold_order(free_blocks: list[int], is_open: list[bool]) -> list[int]:
    """The colds to try, in turn, for a new remote sequence: the open ones with a free
    block, most free lent blocks first (the plan's order between equals)."""
    return sorted((index for index, (free, ok) in enumerate(zip(free_blocks, is_open,
                                                                  strict=True))
                   if ok and free > 0), key=lambda index: -free_blocks[index])


class Ewma:
    """An exponentially weighted mean with a sample count; the plain mean of the first
    1 / alpha samples, so that the first one does not weigh as much as all the rest."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.num = 0

    def add(self, sample: float) -> None:
        self.num += 1
        weight = max(self.alpha, 1.0 / self.num)
        self.value = sample if self.value is None else \
            self.value + weight * (sample - self.value)


# The recent batch's make-up: a mean over about 20 steps.
STEP_ALPHA = 0.05
# A step's time as held to the TPOT target: a mean over about 100 steps, what a sequence's
# TPOT averages over its decode (prefill steps included). A shorter mean cut the cap for a
# burst of arrivals whose prefills lengthened a few seconds of steps, while every
# request's TPOT stayed well under the target: admitted requests then queued instead
# (benchmarks/HISTORY.md, "Goodput: runs 4-6", run 5).
TPOT_ALPHA = 0.01
REMOTE_CAP_DECREASE = 0.75  # the remote cap after woven steps ran over the TPOT target
REMOTE_CAP_HEADROOM = 0.9  # the cap grows while woven steps stay under this share of it
# ... and while the cold model has spent at most this share of its budget's growth (1.05
# of a budget of 1.10); past it the cap holds. Grown up to the budget itself, the cap
# hovered over it between cuts: two hots weaving into one cold ran it at x1.128 against a
# budget of x1.10 (benchmarks/README.md, "A cold model hosting two hot ones").
COLD_BUDGET_HEADROOM = 0.5
# After a cut for the cold budget, the next one waits this long: the cold side measures its
# factor over a window (weaver/weaving/cold_load.py WINDOW_S), which must see the smaller
# batch before it can say whether the cut was enough. So does the cap's growth while the
# cold model measurably pays for the remote sequences (its factor over
# COLD_MEASURABLE_SHARE of the budget's growth): grown once an update, the cap let a window's
# worth of sequences in before the cold side saw the first of them.
COLD_CUT_HOLD_S = 6.0
COLD_MEASURABLE_SHARE = 0.1
# A cut for the cold budget keeps the share of the remote sequences that brings the cold's
# factor back to the headroom's mark if each costs the same (its growth is about linear in
# them), within these bounds: a lone noisy reading costs at most 3/4 of them, and a cold
# far over its budget is brought back in one or two windows, not six 3/4 cuts.
COLD_KEEP_SHARE_MIN = 0.25
# Remote first once a remote sequence adds less than this share of a local one's cost to
# the hot step; local first again once it adds more than a local one (the gap between
# the two keeps fit noise from flipping the order every update).
REMOTE_FIRST_SHARE = 0.9
# ... and only when the fit tells the two costs apart: the saving at least this many
# standard errors of the fit, and neither cost negative. On this CPU a fit on a few noisy
# steps said a remote sequence adds -3.7 ms, or -6.0 ms against a local one's -5.3 ms, and
# put new sequences on the cold with local KV free, where one remote sequence already cost
# the cold its budget (benchmarks/HISTORY.md, "...judged over pooled seeds").
REMOTE_FIRST_Z = 2.0
STEP_MODEL_WINDOW = 256  # recent decode-only steps the step-time model is fitted on
# The most of the sequences that decoded beside remote ones whose TPOT may run over the
# SLO's (the TPOT target over SLO_TPOT_SHARE): half the 10 % a goodput judge allows
# (weaver/results/goodput.py), the other half left to TTFT and noise.
TAIL_SHARE = 0.05
# A try that failed at its smallest (weaving resumed with one remote sequence and stepped
# aside again before the cap grew) doubles the next cool-down, up to 2 ** this: where one
# remote sequence is already more than the cold or the hot step can take, a retry every
# cool-down held lent KV at over the cold's budget each time, and slowed the hot model's
# steps (light hots into a loan-pool cold retried every 20-40 s: benchmarks/HISTORY.md,
# "...the frontend off the cold core"). A try whose cap grew past one resets it.
MAX_COOLDOWN_DOUBLINGS = 3


class StepTimeModel:
    """Decode step time as fixed cost + a cost per local and per remote sequence, fitted by
    least squares over recent decode-only steps (prefill chunks would blur it). It answers
    what a batch's tokens/s would be, so a woven batch is judged against the local-only
    batch it grew from at the same moment, not against steps measured under other loads."""

    def __init__(self, window: int = STEP_MODEL_WINDOW) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coefficients: tuple[float, float, float] | None = None
        self._covariance: np.ndarray | None = None  # of the coefficients, from the residuals

    def add(self, num_local: int, num_remote: int, step_s: float) -> None:
        self.samples.append((num_local, num_remote, step_s))
        self._coefficients = self._covariance = None

    def coefficients(self, min_samples: int) -> tuple[float, float, float] | None:
        """(fixed, per local, per remote) seconds; None until the steps tell them apart."""
        if self._coefficients is None and len(self.samples) >= min_samples:
            data = np.asarray(self.samples, dtype=float)
            design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
            if np.linalg.matrix_rank(design) == 3:
                fit, *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
                self._coefficients = (float(fit[0]), float(fit[1]), float(fit[2]))
                residuals = data[:, 2] - design @ fit
                variance = residuals @ residuals / max(len(data) - 3, 1)
                self._covariance = variance * np.linalg.inv(design.T @ design)
        return self._coefficients

    def contrast_z(self, weights: tuple[float, float, float], min_samples: int
                   ) -> float | None:
        """weights . coefficients over its standard error (how many errors the fit puts it
        from 0; +-inf for a fit without residuals); None until the fit exists."""
        fit = self.coefficients(min_samples)
        if fit is None or self._covariance is None:
            return None
        vector = np.asarray(weights, dtype=float)
        value = float(vector @ np.asarray(fit))
        error = math.sqrt(max(float(vector @ self._covariance @ vector), 0.0))
        if error > 1e-12 * max(abs(value), 1e-12):
            return value / error
        # An exact fit (the simulator's step model) has no error: its sign is certain.
        return math.copysign(math.inf, value) if value else 0.0

    def gain(self, num_local: int, num_remote: int, min_samples: int) -> float | None:
        """tokens/s of (num_local + num_remote) over tokens/s of num_local alone."""
        fit = self.coefficients(min_samples)
        if fit is None or num_local < 1 or num_remote < 1:
            return None
        fixed, per_local, per_remote = fit
        alone = fixed + per_local * num_local
        woven = alone + per_remote * num_remote
        if alone <= 0 or woven <= 0:
            return None  # a fit without meaning (noise on too few distinct batches)
        return ((num_local + num_remote) / woven) / (num_local / alone)


class AdaptivePlacement:
    """`offload_ratio: auto`: local first and remote on overflow (remote first while a
    remote sequence is the cheaper one for the hot step), while weaving pays.

    How many sequences may be remote is a cap, additive increase and multiplicative
    decrease (as TCP finds a link's rate): none at first (the remote pool fills as far as
    demand goes); 3/4 of the remote sequences running once the woven steps' mean time runs
    over the TPOT target; once the cold model's TPOT runs over its budget, the share that
    brings it back under half its budget's growth (1/4 to 3/4, `cold_keep_share`), the
    rest given back if it is still over a window later (`shed_for_cold`); no cut again
    until the cold side has measured the smaller batch. One more each update the woven
    steps stay under 90 % of the target and the cold model under half its budget's growth
    (past that, the cap holds; with none yet, it is set to the sequences running remote);
    while the cold measurably pays for them, one more per cold window. A cap that falls to
    0 steps weaving aside for the cool-down (doubled for each try in a row that failed at
    one remote sequence); then it resumes with a cap of one, once the cold model is under
    half its budget's growth. One noisy reading of the cold factor
    costs at most 3/4 of the remote sequences, not all of them."""

    def __init__(self, targets: AdaptiveTargets | None = None) -> None:
        self.targets = targets or AdaptiveTargets()
        self.is_open = True
        self.reason = "weaving: spill to the cold pool when the local KV is full"
        self.num_step_asides = 0
        self.remote_cap: int | None = None  # most remote sequences at once; None: no cap
        self._closed_until = -math.inf
        self.num_failed_tries = 0  # tries in a row that failed at one remote sequence
        self._cap_grew_since_resume = True  # the first step-aside is not a failed retry
        self._cold_cut_held_until = -math.inf
        self._cold_growth_held_until = -math.inf
        # By cold (plan order): over its budget, unbroken, since then or since its last shed.
        self._over_budget_since: dict[int, float] = {}
        # Remote sequences each cold (plan order) gave back for its budget.
        self.num_shed_on: list[int] = []
        self._local_step = Ewma(TPOT_ALPHA)  # step time of local-only steps (s)
        self._woven_step = Ewma(TPOT_ALPHA)  # step time of steps with remote sequences
        # The recent woven batch: its local and remote sequences.
        self._woven_local = Ewma(STEP_ALPHA)
        self._woven_remote = Ewma(STEP_ALPHA)
        self._num_remote = 0  # remote sequences in the last step
        self.model = StepTimeModel()
        self.gain: float | None = None  # the woven batch's predicted tokens/s gain
        self.remote_first = False  # a remote sequence is cheaper for the hot step
        self.load = PairLoad()
        self.tail = TpotTail()  # finished sequences' TPOTs, from the steps' times

    @property
    def hot_tpot_target_s(self) -> float | None:
        if self.targets.hot_tpot_s is not None:
            return self.targets.hot_tpot_s
        base = self._local_step.value
        return None if base is None else self.targets.hot_budget * base

    @property
    def hot_tpot_slo_s(self) -> float | None:
        """The SLO's TPOT, which the target is SLO_TPOT_SHARE of (a planned pair's)."""
        target = self.hot_tpot_target_s
        return None if target is None else target / SLO_TPOT_SHARE

    def cold_factor(self, index: int) -> float | None:
        """The `index`-th cold's TPOT factor (None: not measured; a load read without its
        list of colds is the one cold's)."""
        factors = self.load.cold_inflations
        if not factors and index == 0:
            return self.load.cold_inflation
        return factors[index] if index < len(factors) else None

    def cold_is_open(self, index: int) -> bool:
        """Whether the `index`-th cold may take a new remote sequence: not while its TPOT
        is over its budget (the others may)."""
        factor = self.cold_factor(index)
        return factor is None or factor <= self.targets.cold_budget

    def order(self, num_running_local: int, num_running_remote: int) -> list[Placement]:
        cap = self.remote_cap
        if not self.is_open or (cap is not None and num_running_remote >= cap):
            return [Placement.LOCAL]
        if self.remote_first:
            return [Placement.REMOTE, Placement.LOCAL]
        return [Placement.LOCAL, Placement.REMOTE]

    # --- measurements -------------------------------------------------------------------
    def observe_step(self, step_s: float, num_local: int, num_remote: int,
                     is_decode_only: bool = True) -> None:
        """One finished hot step: its wall time, the requests it ran, and whether it ran
        decodes only (no prompt chunk)."""
        if step_s <= 0 or num_local + num_remote == 0:
            return
        self._num_remote = num_remote
        self.tail.add_step(step_s, num_remote > 0)
        if num_remote == 0:
            self._local_step.add(step_s)
        else:
            self._woven_local.add(num_local)
            self._woven_remote.add(num_remote)
            # Over the cap, the batch is still the one the cap was cut for: its steps say
            # nothing of the smaller batch to come.
            if self.remote_cap is None or num_remote <= self.remote_cap:
                self._woven_step.add(step_s)
        if is_decode_only:
            self.model.add(num_local, num_remote, step_s)

    def observe_pair(self, load: PairLoad) -> None:
        self.load = load

    def observe_finished(self, num_output_tokens: int) -> None:
        """A hot sequence finished with the step last observed, with that many tokens."""
        if self.is_open:
            self.tail.add_finished(num_output_tokens)

    # --- the decision ---------------------------------------------------------------------
    def update(self, now: float) -> bool:
        """Re-decide how many sequences may be remote; True if weaving stepped aside or
        resumed."""
        t = self.targets
        if self._woven_remote.num:
            self.gain = self.model.gain(round(self._woven_local.value),
                                        round(self._woven_remote.value), t.min_samples)
        self._choose_first_pool()
        if not self.is_open:
            # Resumed at the budget itself, one sequence put the cold back over it.
            if now < self._closed_until or not self._cold_has_headroom():
                return False
            self.is_open, self.remote_cap = True, 1
            self._cap_grew_since_resume = False
            self.reason = "weaving resumed: the cool-down passed; one remote sequence at first"
            self._woven_step = Ewma(TPOT_ALPHA)  # its TPOT is measured afresh
            self.tail.restart()
            return True
        reason = self._cut_for_cold(now) or self._judge_tail() or self._adjust_cap(now)
        if reason is None:
            return False
        self.is_open = False
        self.tail.restart()
        self.num_step_asides += 1
        self.num_failed_tries = 0 if self._cap_grew_since_resume else self.num_failed_tries + 1
        cooldown_s = self.cooldown_s()
        self._closed_until = now + cooldown_s
        self.reason = f"{reason}; weaving tries again in {cooldown_s:.0f} s at the earliest"
        return True

    def cooldown_s(self) -> float:
        """How long weaving stays aside now: the cool-down, doubled for each try in a row
        that failed at one remote sequence (MAX_COOLDOWN_DOUBLINGS at most)."""
        return self.targets.cooldown_s * 2 ** min(self.num_failed_tries,
                                                  MAX_COOLDOWN_DOUBLINGS)

    def _choose_first_pool(self) -> None:
        """Remote first while the step-time model says a remote sequence costs the hot step
        clearly less than a local one (on a device whose attention is a large share of
        the step, the cold device then does that share)."""
        min_samples = self.targets.min_samples
        fit = self.model.coefficients(min_samples)
        if fit is None:
            return
        _, per_local, per_remote = fit
        saving_z = self.model.contrast_z((0.0, REMOTE_FIRST_SHARE, -1.0), min_samples)
        cheaper = per_local > 0 and per_remote >= 0 and saving_z is not None \
            and saving_z >= REMOTE_FIRST_Z
        dearer = per_remote > per_local
        if cheaper and not self.remote_first or dearer and self.remote_first:
            self.remote_first = cheaper
            self.reason = (f"weaving: {'remote' if cheaper else 'local'} first (a remote "
                           f"sequence adds {1000 * per_remote:.2f} ms to the hot step, a "
                           f"local one {1000 * per_local:.2f} ms)")

    def _cold_over_budget(self) -> str | None:
        inflation, budget = self.load.cold_inflation, self.targets.cold_budget
        if inflation is not None and inflation > budget:
            return (f"the cold model's TPOT is x{inflation:.3f} its own, over its budget "
                    f"x{budget:.3f}")
        return None

    def _cold_has_headroom(self) -> bool:
        """Whether the cold model has spent at most COLD_BUDGET_HEADROOM of its budget's
        growth (true while its factor is unknown)."""
        inflation = self.load.cold_inflation
        budget = self.targets.cold_budget
        return inflation is None or inflation <= 1 + COLD_BUDGET_HEADROOM * (budget - 1)

    def _cut_for_cold(self, now: float) -> str | None:
        """Cut the remote cap when the cold model is over its budget; a reason to step aside
        when the cut leaves none."""
        over = self._cold_over_budget()
        if over is None or now < self._cold_cut_held_until or self._num_remote == 0:
            return None
        self._cold_cut_held_until = now + COLD_CUT_HOLD_S
        # The batch the cold side's window measured: the recent woven steps' remote
        # sequences, not the last step's alone (a step that happened to run few of them cut
        # the cap to one, measured: benchmarks/HISTORY.md, "Goodput: runs 4-6").
        recent = round(self._woven_remote.value or 0)
        return self._cut(max(self._num_remote, recent), over,
                         self.cold_keep_share(self.load.cold_inflation))

    def cold_keep_share(self, inflation: float) -> float:
        """The share of its remote sequences a cold at `inflation` keeps in a cut: the one
        that would bring it to the headroom's mark (COLD_KEEP_SHARE_MIN..3/4)."""
        mark = 1 + COLD_BUDGET_HEADROOM * (self.targets.cold_budget - 1)
        share = (mark - 1) / (inflation - 1) if inflation > 1 else REMOTE_CAP_DECREASE
        return min(REMOTE_CAP_DECREASE, max(COLD_KEEP_SHARE_MIN, share))

    def shed_for_cold(self, num_running_on: list[int], now: float) -> list[int]:
        """How many of its remote sequences each cold (plan order; `num_running_on`: how
        many run there) should give back now: of a cold over its budget for a whole
        COLD_CUT_HOLD_S (the cap's cut was not enough), those over the share a cut keeps
        (all of one), then not again for COLD_CUT_HOLD_S (its window must see the smaller
        batch first). The hot scheduler preempts them (vLLM recomputes them later, placed
        as the policy then says); the cap's cut keeps them from coming back.

        Why wait a window: a preempted sequence waits at the head of the queue until the
        local KV has room for it, which in a KV-bound hot model holds back every request
        behind it. Shedding at the first reading over the budget lost the simulator's
        Llama-2-13B A100-40GB conv cell its +50 % under the tight SLO (at 1.5 req/s the
        hot attainment of seeds 1-2 fell from 1.00/0.78 to 0.95/0.77) for spikes the cut
        alone ended; waiting a window kept it."""
        budget = self.targets.cold_budget
        shed = [0] * len(num_running_on)
        for cold, num_running in enumerate(num_running_on):
            factor = self.cold_factor(cold)
            if factor is None or factor <= budget:
                self._over_budget_since.pop(cold, None)
                continue
            since = self._over_budget_since.setdefault(cold, now)
            if num_running == 0 or now - since < COLD_CUT_HOLD_S:
                continue
            self._over_budget_since[cold] = now  # the next shed: a window from this one
            shed[cold] = num_running - int(self.cold_keep_share(factor) * num_running)
        self.num_shed_on += [0] * (len(shed) - len(self.num_shed_on))
        for cold, num in enumerate(shed):
            self.num_shed_on[cold] += num
        return shed

    def _judge_tail(self) -> str | None:
        """A reason to step aside when too many of the sequences that decoded beside remote
        ones ran over the SLO's TPOT: the lent KV admitted more than the hot step serves
        within it (a short sequence decoding through a burst of prompt chunks), which no
        cap on the remote sequences alone undoes."""
        slo = self.hot_tpot_slo_s
        share = None if slo is None else self.tail.share_over(slo)
        if share is None or share <= TAIL_SHARE:
            return None
        return (f"stepped aside: {share:.0%} of {len(self.tail.tpots_s)} sequences that "
                f"decoded beside remote ones ran over the SLO's TPOT {1000 * slo:.1f} ms "
                f"(at most {TAIL_SHARE:.0%} may)")

    def _cut(self, num_running_remote: int, why: str,
             keep_share: float = REMOTE_CAP_DECREASE) -> str | None:
        """The remote cap to `keep_share` (3/4 unless the cold budget says less) of the
        sequences running remote, or of the cap when more run than it allows (admitted
        before it was set): a cut never raises the cap (one did, 12 -> 16, for the cold
        budget with 21 running). A reason to step aside when that is none."""
        base = num_running_remote if self.remote_cap is None \
            else min(num_running_remote, self.remote_cap)
        self.remote_cap = int(keep_share * base)
        # Judge the smaller batch afresh: its step time, its make-up, its sequences.
        self._woven_step = Ewma(TPOT_ALPHA)
        self._woven_local, self._woven_remote = Ewma(STEP_ALPHA), Ewma(STEP_ALPHA)
        self.tail.restart()
        if self.remote_cap == 0:
            return f"stepped aside: {why}, with {num_running_remote} remote sequence(s)"
        self.reason = f"weaving: at most {self.remote_cap} remote sequences ({why})"
        return None

    def _adjust_cap(self, now: float) -> str | None:
        """Move the remote cap by the woven steps' mean time, within the cold's room; a
        reason to step aside when it reaches 0."""
        if not self._cold_has_headroom() and self.remote_cap is None and self._num_remote:
            self.remote_cap = self._num_remote  # no more growth than the cold has room for
            self.reason = (f"weaving: at most {self.remote_cap} remote sequences (the "
                           f"cold model's TPOT is x{self.load.cold_inflation:.3f} its "
                           f"own, near its budget x{self.targets.cold_budget:.3f})")
        target, woven = self.hot_tpot_target_s, self._woven_step
        if target is None or woven.num < self.targets.min_tpot_samples:
            return None
        if woven.value > target:
            # The recent woven batch's remote part.
            return self._cut(round(self._woven_remote.value),
                             f"woven hot steps take {1000 * woven.value:.1f} ms on average, "
                             f"over the TPOT target {1000 * target:.1f} ms")
        if not self._cold_has_headroom() or now < self._cold_growth_held_until:
            return None
        if woven.value < REMOTE_CAP_HEADROOM * target and self.remote_cap is not None \
                and self._num_remote >= self.remote_cap:
            self.remote_cap += 1
            self._cap_grew_since_resume = True
            self.reason = f"weaving: at most {self.remote_cap} remote sequences"
            if self._cold_pays_measurably():
                self._cold_growth_held_until = now + COLD_CUT_HOLD_S
        return None

    def _cold_pays_measurably(self) -> bool:
        inflation = self.load.cold_inflation
        return inflation is not None and \
            inflation > 1 + COLD_MEASURABLE_SHARE * (self.targets.cold_budget - 1)

    def report(self) -> dict[str, float | int | str | bool | None]:
        """The policy's state, for /metrics and the log."""
        fit = self.model.coefficients(self.targets.min_samples)
        return {"policy": AUTO, "weaving_active": self.is_open, "reason": self.reason,
                "step_asides": self.num_step_asides, "remote_cap": self.remote_cap,
                "failed_tries_in_a_row": self.num_failed_tries,
                "cold_budget_preemptions": list(self.num_shed_on),
                "hot_tpot_target_s": self.hot_tpot_target_s,
                "hot_local_step_s": self._local_step.value,
                "hot_woven_step_s": self._woven_step.value,
                "tpot_over_slo_share": (None if self.hot_tpot_slo_s is None
                                        else self.tail.share_over(self.hot_tpot_slo_s)),
                "woven_gain": self.gain, "remote_first": self.remote_first,
                "step_model_s": None if fit is None else list(fit),
                "cold_inflation": self.load.cold_inflation,
                "offload_wait_s": self.load.offload_wait_s}


def placement_for(offload_ratio: float | str,
                  targets: AdaptiveTargets | None = None) -> RatioPlacement | AdaptivePlacement:
    """The policy an `offload_ratio` value names: "auto" or a fixed share in [0, 1]."""
    if offload_ratio == AUTO:
        return AdaptivePlacement(targets)
    if isinstance(offload_ratio, str):
        raise ValueError(f"offload_ratio must be 'auto' or a number in [0, 1], got "
                         f"{offload_ratio!r}")
    return RatioPlacement(float(offload_ratio))
