"""Calibrate a profile's woven step against the real weaving path (pure half).

`OffloadCostModel` prices what a hot step with remote sequences adds: per layer the q/kv
transfer, the cold side's poll wait and remote attention, less the local attention that
overlaps them. A served woven step pays more than that on the hot side: the batch is split
into local and remote rows (one kernel call each, metadata built for both), the remote
rows' task is staged, and their outputs are merged back. This module fits that remainder
from points measured by a streaming client through `weaver serve` running a weaving
deployment with its cold model idle (`weaver.profiling.serving_probe.measure_woven_points`):

    overhead(point) = served TPOT - (decode(b, ctx) + OffloadCostModel.step_overhead(r, ...))

with the profile's decode table already serving-calibrated (so the served path's own
per-step costs are not counted twice), r the remote sequences of a batch of b placed by
the hot scheduler's `RatioPlacement`, and an idle cold device (poll wait: half the idle
poller's period). The fit is a least-squares line over r, max(0, a + k r), written to the
profile's `woven_step_intercept_s` and `woven_step_per_remote_seq_s`; the simulator adds
it once per step that has remote sequences.

No vLLM or torch import here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from weaver.profiling.engine_profile import least_squares
from weaver.profiling.serving_calibration import NOTES_KEY as SERVING_NOTES_KEY
from weaver.profiling.serving_calibration import ServingDecodePoint
from weaver.sim.perf_model import (
    IDLE_POLL_INTERVAL_S,
    LinkModel,
    OffloadCostModel,
    PerfModel,
    PollContext,
    operator_fractions,
)
from weaver.sim.profile import Profile
from weaver.weaving.placement import Placement, RatioPlacement

NOTES_KEY = "weaving_calibration"


def num_remote_of(offload_ratio: float | str, batch_size: int) -> int:
    """Remote sequences among `batch_size` requests admitted one after another into an
    empty hot engine by `RatioPlacement` (its remote pool large enough for all)."""
    if isinstance(offload_ratio, str):
        raise ValueError(f"offload_ratio {offload_ratio!r} places by live load; the weaving "
                         "calibration needs a fixed share of remote sequences: give the pair "
                         "one for calibrating (e.g. offload_ratio: 0.5)")
    placement = RatioPlacement(offload_ratio)
    num_local = num_remote = 0
    for _ in range(batch_size):
        if placement.preferred(num_local, num_remote) is Placement.REMOTE:
            num_remote += 1
        else:
            num_local += 1
    return num_remote


@dataclass(frozen=True)
class WovenComparison:
    point: ServingDecodePoint  # b requests decoding together on the hot model of a pair
    num_remote: int
    modelled_s: float  # the profile's decode step plus the offload cost model's overhead

    @property
    def overhead_s(self) -> float:
        return self.point.tpot_s - self.modelled_s


@dataclass(frozen=True)
class WovenFit:
    intercept_s: float  # a: per woven step
    per_remote_seq_s: float  # k: per remote sequence of a woven step
    offload_ratio: float
    points: tuple[WovenComparison, ...]

    def overhead_s(self, num_remote: int) -> float:
        # Clamped at 0 as in the simulator (PerfModel.woven_step_overhead).
        return max(0.0, self.intercept_s + self.per_remote_seq_s * num_remote)


def modelled_woven_step_s(perf: PerfModel, batch_size: int, num_remote: int,
                          context_tokens: float) -> float:
    """What the simulator prices for this woven step with the cold side idle, without any
    woven-step calibration (the profile passed must not carry one)."""
    cost = OffloadCostModel(perf, perf, LinkModel(perf.profile.link_bandwidth_bps,
                                                  perf.profile.link_latency_s))
    per_seq = context_tokens / batch_size
    idle = PollContext(perf.decode_time(1, 0), operator_fractions(perf.shape), 0.0,
                       IDLE_POLL_INTERVAL_S)
    return (perf.decode_time(batch_size, round(context_tokens))
            + cost.step_overhead(num_remote, round(per_seq * num_remote),
                                 round(per_seq * (batch_size - num_remote)), idle))


def require_calibratable(profile: Profile) -> None:
    """A serving-calibrated profile without a woven-step calibration yet."""
    if SERVING_NOTES_KEY not in profile.notes:
        raise ValueError("calibrate the serving path first (weaver profile "
                         "--calibrate-serving): the woven-step overhead is what a served "
                         "woven step pays beyond a served plain step")
    if (NOTES_KEY in profile.notes or profile.woven_step_intercept_s
            or profile.woven_step_per_remote_seq_s):
        raise ValueError(f"this profile already has a woven-step calibration (notes."
                         f"{NOTES_KEY}); calibrate the profile it came from")


def fit_woven_overhead(profile: Profile, points: Sequence[ServingDecodePoint],
                       offload_ratio: float) -> WovenFit:
    """The woven-step overhead over `profile`, from decode points of the hot model."""
    require_calibratable(profile)
    perf = PerfModel(profile)
    compared = []
    for point in points:
        num_remote = num_remote_of(offload_ratio, point.batch_size)
        compared.append(WovenComparison(point, num_remote, modelled_woven_step_s(
            perf, point.batch_size, num_remote, point.mean_context_tokens)))
    if any(c.num_remote == 0 for c in compared):
        raise ValueError(f"offload ratio {offload_ratio}: a decode point has no remote "
                         "sequence; use larger batch sizes or a larger ratio")
    # Unclamped coefficients, as the serving calibration's: the clamp is on the values.
    intercept, slope = least_squares([c.num_remote for c in compared],
                                     [c.overhead_s for c in compared])
    return WovenFit(intercept, slope, offload_ratio, tuple(compared))


def apply_woven_overhead(profile: Profile, fit: WovenFit, *, measured_at: str,
                         command: str, conditions: str) -> Profile:
    """`profile` with the fit in its `woven_step_*` fields and the points in its notes."""
    record = {
        "measured_at": measured_at,
        "command": command,
        "conditions": conditions,
        "offload_ratio": fit.offload_ratio,
        "intercept_s": fit.intercept_s,
        "per_remote_seq_s": fit.per_remote_seq_s,
        "points": [{**asdict(c.point), "num_remote": c.num_remote,
                    "modelled_s": c.modelled_s} for c in fit.points],
    }
    summary = (f"woven-step calibrated {measured_at}: max(0, {fit.intercept_s * 1e3:.2f} ms "
               f"+ {fit.per_remote_seq_s * 1e3:.3f} ms x remote sequences) per woven step "
               f"(measured through weaver serve; notes.{NOTES_KEY})")
    notes = {**profile.notes, NOTES_KEY: json.dumps(record), "woven_step_overhead": summary}
    return replace(profile, source=f"{profile.source}; {summary}",
                   woven_step_intercept_s=fit.intercept_s,
                   woven_step_per_remote_seq_s=fit.per_remote_seq_s, notes=notes)
