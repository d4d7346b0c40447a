"""Turn a trace and a `WorkloadSpec` into the `TraceRequest`s a benchmark sends.

The one place where the workload's seed is used: every random draw (which trace rows,
which arrival gaps, which model a replayed row goes to) comes from generators spawned from
`WorkloadSpec.seed`, so one spec always yields the same requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from weaver.workloads.arrivals import (
    gamma_arrivals,
    phased,
    poisson_arrivals,
    trace_arrivals,
    trace_rate,
)
from weaver.workloads.filters import apply_filter, default_filter_name, get_filter
from weaver.workloads.lengths import scale_lengths
from weaver.workloads.popularity import power_law_rates, split_count
from weaver.workloads.traces import TraceRow, load_trace
from weaver.workloads.types import TraceRequest

logger = logging.getLogger(__name__)

TWIN_PREFIX = "same:"  # --model NAME=same:OTHER: NAME is sent a copy of OTHER's requests


class ArrivalKind(str, Enum):
    POISSON = "poisson"
    GAMMA = "gamma"
    TRACE = "trace"


@dataclass(frozen=True)
class ModelLoad:
    """One model of the workload; `rate` in req/s, or None to take a share of the total.
    With `phases` (on seconds, off seconds) the model sends at `rate` for `on` seconds, then
    nothing for `off` seconds, over and over (arrivals.phased). With `same_as` the model is
    sent a copy of that model's requests (the same arrival times and lengths): two setups
    served side by side then see the same load, not two draws of it."""

    name: str
    rate: float | None = None
    phases: tuple[float, float] | None = None
    same_as: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelLoad:
        """`NAME`, `NAME=RATE`, `NAME=RATE@ON/OFF` or `NAME=same:OTHER` (the CLI's --model
        value)."""
        name, sep, rate_text = text.partition("=")
        if not name.strip():
            raise ValueError(f"--model {text!r}: empty model name; use NAME or NAME=RATE")
        if not sep:
            return cls(name.strip())
        if rate_text.startswith(TWIN_PREFIX):
            source = rate_text[len(TWIN_PREFIX):].strip()
            if not source:
                raise ValueError(f"--model {text!r}: name the model whose requests to copy, "
                                 f"e.g. {name.strip()}={TWIN_PREFIX}plain")
            return cls(name.strip(), same_as=source)
        rate_text, at, phase_text = rate_text.partition("@")
        try:
            rate = float(rate_text)
        except ValueError:
            raise ValueError(f"--model {text!r}: rate {rate_text!r} is not a number (or "
                             f"{TWIN_PREFIX}MODEL to copy MODEL's requests)") from None
        if not rate > 0:
            raise ValueError(f"--model {text!r}: the rate must be > 0 req/s")
        if not at:
            return cls(name.strip(), rate)
        try:
            on_s, off_s = (float(part) for part in phase_text.split("/"))
        except ValueError:
            raise ValueError(f"--model {text!r}: phases {phase_text!r} are not ON/OFF seconds, "
                             f"e.g. {name.strip()}={rate_text}@60/60") from None
        if not on_s > 0 or not off_s > 0:
            raise ValueError(f"--model {text!r}: both phases must be > 0 s")
        return cls(name.strip(), rate, (on_s, off_s))

    def mean_rate(self, rate: float) -> float:
        """The model's rate over whole on/off cycles, when it sends at `rate` while on."""
        if self.phases is None:
            return rate
        on_s, off_s = self.phases
        return rate * on_s / (on_s + off_s)


@dataclass
class WorkloadSpec:
    models: list[ModelLoad]
    trace: str = "azure-conv"  # azure-conv | azure-code | burstgpt:PATH
    rate: float | None = None  # total req/s over all models (None: per-model rates/trace)
    arrival: ArrivalKind = ArrivalKind.POISSON
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    num_requests: int = 100
    length_scale: float = 1.0
    max_model_len: int | None = None
    power_law_alpha: float = 0.0  # MuxServe popularity; 0 = even split of `rate`
    time_scale: float | None = None  # trace arrivals only; None: from `rate` or 1.0
    filter_name: str | None = None  # None: the paper's filter for this trace
    seed: int = 0
    traces_dir: str | None = None

    def __post_init__(self) -> None:
        try:
            self.arrival = ArrivalKind(self.arrival)
        except ValueError:
            choices = [kind.value for kind in ArrivalKind]
            raise ValueError(f"unknown arrival {self.arrival!r}; choose one of {choices}") from None
        if not self.models:
            raise ValueError("a workload needs at least one model (--model NAME[=RATE])")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names repeat in {names}; give each model once")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 req/s, got {self.rate}")
        by_name = {m.name: m for m in self.models}
        for twin in self.models:
            if twin.same_as is None:
                continue
            source = by_name.get(twin.same_as)
            if source is None or source is twin:
                raise ValueError(f"--model {twin.name}={TWIN_PREFIX}{twin.same_as}: "
                                 f"{twin.same_as!r} must be another of the models {names}")
            if source.same_as is not None:
                raise ValueError(f"--model {twin.name}={TWIN_PREFIX}{twin.same_as}: "
                                 f"{twin.same_as!r} copies {source.same_as!r} itself; name "
                                 f"{source.same_as!r} instead")
            # A copy is sent its model's requests, at their times: a rate or phases of its
            # own would be ignored, so they are refused. (Its phases once copied are its
            # model's: a spec built again from these models passes.)
            if twin.rate is not None or twin.phases not in (None, source.phases):
                raise ValueError(f"model {twin.name!r} copies {twin.same_as!r}'s requests and "
                                 f"takes its rate and phases; give {twin.name!r} no rate or "
                                 f"phases of its own (set them on {twin.same_as!r})")
        # A copy sends in its model's phases too (for its offered rate and the results).
        self.models = [replace(m, phases=by_name[m.same_as].phases) if m.same_as is not None
                       else m for m in self.models]
        phased_models = [m.name for m in self.models if m.phases is not None]
        if phased_models and self.arrival is ArrivalKind.TRACE:
            raise ValueError(f"on/off phases ({phased_models}) move drawn arrivals; with "
                             f"--arrival trace the trace's own times are replayed: use poisson "
                             f"or gamma arrivals")


def drawn_models(spec: WorkloadSpec) -> list[ModelLoad]:
    """The models whose requests are drawn (all but the copies of another's)."""
    return [m for m in spec.models if m.same_as is None]


def model_rates(spec: WorkloadSpec) -> list[float] | None:
    """Per-model rates, in the order of `spec.models`: given per model, or `rate` split by the
    power law over the drawn models; a copy has its model's rate. None only for trace
    arrivals with no rate anywhere (replay at the trace's speed, even model split)."""
    drawn = drawn_models(spec)
    rates = _drawn_rates(spec, drawn)
    if rates is None:
        return None
    by_name = {m.name: rate for m, rate in zip(drawn, rates, strict=True)}
    return [by_name[m.same_as or m.name] for m in spec.models]


def _drawn_rates(spec: WorkloadSpec, drawn: Sequence[ModelLoad]) -> list[float] | None:
    """model_rates for the drawn models alone, in their order."""
    given = [m.rate for m in drawn if m.rate is not None]
    if len(given) == len(drawn):
        if spec.rate is not None:
            raise ValueError("give either per-model rates (--model NAME=RATE) or --rate, not both")
        return given
    if given:
        raise ValueError("give a rate for every model (NAME=RATE) or for none of them (--rate)")
    if spec.rate is None:
        if spec.arrival is ArrivalKind.TRACE:
            return None
        raise ValueError("--rate is required with poisson or gamma arrivals")
    return power_law_rates(len(drawn), spec.rate, spec.power_law_alpha)


def load_rows(spec: WorkloadSpec) -> list[TraceRow]:
    rows = load_trace(spec.trace, spec.traces_dir)
    row_filter = get_filter(spec.filter_name or default_filter_name(spec.trace))
    kept = apply_filter(rows, row_filter)
    if not kept:
        raise ValueError(f"no row of {spec.trace} passes the filter; try --filter none")
    logger.info("trace %s: %d of %d rows pass the filter", spec.trace, len(kept), len(rows))
    return kept


def build_workload(
    spec: WorkloadSpec, rows: Sequence[TraceRow] | None = None
) -> list[TraceRequest]:
    """The workload's requests sorted by arrival, `request_id` = position."""
    rows = list(rows) if rows is not None else load_rows(spec)
    if not rows:
        raise ValueError("the trace has no rows to sample from")
    drawn = drawn_models(spec)
    rates = _drawn_rates(spec, drawn)
    # One generator per drawn model, the same ones as without copies (a copy draws nothing).
    seeds = np.random.SeedSequence(spec.seed).spawn(len(drawn) + 1)
    if spec.arrival is ArrivalKind.TRACE:
        drafts = _replay_trace(spec, drawn, rows, rates, np.random.default_rng(seeds[-1]))
    else:
        assert rates is not None  # model_rates raises for poisson/gamma without a rate
        drafts = []
        # Counts by the rate over whole cycles, so that every model's requests span the
        # same time.
        counts = split_count(spec.num_requests, [
            model.mean_rate(rate) for model, rate in zip(drawn, rates, strict=True)])
        for model, rate, count, seed in zip(drawn, rates, counts, seeds, strict=False):
            rng = np.random.default_rng(seed)
            drafts += _sample_model(spec, model, rate, count, rows, rng)
    drafts += [(arrival_s, row, twin.name) for twin in spec.models if twin.same_as is not None
               for arrival_s, row, model in drafts if model == twin.same_as]
    drafts.sort(key=lambda d: d[0])  # stable: ties keep model order, copies after
    requests = []
    for request_id, (arrival_s, row, model) in enumerate(drafts):
        num_in, num_out = scale_lengths(
            row.input_tokens, row.output_tokens, spec.length_scale, spec.max_model_len
        )
        requests.append(TraceRequest(arrival_s, num_in, num_out, model, request_id))
    return requests


def _sample_model(
    spec: WorkloadSpec,
    model: ModelLoad,
    rate: float,
    count: int,
    rows: Sequence[TraceRow],
    rng: np.random.Generator,
) -> list[tuple[float, TraceRow, str]]:
    # Without replacement while the trace has enough rows (vLLM's samplers do the same).
    index = rng.choice(len(rows), size=count, replace=count > len(rows))
    if spec.arrival is ArrivalKind.GAMMA:
        times = gamma_arrivals(count, rate, spec.burstiness, rng)
    else:
        times = poisson_arrivals(count, rate, rng)
    if model.phases is not None:
        times = phased(times, *model.phases)
    return [(t, rows[int(i)], model.name) for t, i in zip(times, index, strict=True)]


def _replay_trace(
    spec: WorkloadSpec,
    models: Sequence[ModelLoad],
    rows: Sequence[TraceRow],
    rates: list[float] | None,
    rng: np.random.Generator,
) -> list[tuple[float, TraceRow, str]]:
    # The first N rows keep the trace's burst structure; a random subset would thin it.
    window = list(rows[: spec.num_requests])
    if len(window) < spec.num_requests:
        logger.warning(
            "trace has %d rows after filtering; replaying all of them, not %d",
            len(window),
            spec.num_requests,
        )
    stamps = [row.timestamp_s for row in window]
    if spec.time_scale is not None:
        scale = spec.time_scale
    elif rates is not None and len(window) > 1:
        scale = trace_rate(stamps) / sum(rates)  # stretch the trace to the requested rate
    else:
        scale = 1.0
    weights = np.asarray(rates if rates is not None else [1.0] * len(models), dtype=float)
    picks = rng.choice(len(models), size=len(window), p=weights / weights.sum())
    times = trace_arrivals(stamps, scale)
    return [(t, row, models[int(m)].name) for t, row, m in zip(times, window, picks, strict=True)]


def describe_workload(requests: Sequence[TraceRequest]) -> dict[str, dict[str, float]]:
    """Per-model count, mean lengths and offered rate (for logs and results)."""
    out: dict[str, dict[str, float]] = {}
    span = max((r.arrival_s for r in requests), default=0.0)
    for model in sorted({r.model for r in requests}):
        mine = [r for r in requests if r.model == model]
        out[model] = {
            "num_requests": len(mine),
            "mean_input_tokens": float(np.mean([r.input_tokens for r in mine])),
            "mean_output_tokens": float(np.mean([r.output_tokens for r in mine])),
            "offered_rate": len(mine) / span if span > 0 else float("nan"),
        }
    return out
