"""Goodput found by search: the highest request rate a deployment serves in a steady state
with >= 90 % of its requests within the SLO (DistServe's goodput; the definitions of
attainment and goodput are weaver/results/goodput.py's, used here, never restated).

- A **run** sends `num_requests` open-loop arrivals at one rate with one workload seed (more
  where `min_span_s` asks for it: rate x min_span_s, so that a fast rate's arrivals last as
  long as a slow one's). Its first `warmup_requests` (by arrival) warm the server up and are
  left out; attainment is over the rest, the measured requests, and a request outstanding
  at the run's deadline (last arrival + `drain_s`) is a miss.
- A run is **not steady** when it measured a drain or a burst rather than a steady state:
  more than 5 % of its measured requests were still outstanding at the deadline, or their
  TTFT kept growing (the last third's median TTFT, by arrival, more than twice the first
  third's and more than max(50 ms, TTFT target / 4) above it, with the middle third's
  already a quarter of that growth above the first: a queue rises through the run, while
  a few long requests near its end raise the last third alone), or its measured arrivals
  spanned less than 3x their median lifetime (arrival to last token): a server that holds
  a whole run's requests at once absorbs it as one burst, whatever its sustainable rate.
  Above capacity a queue builds for as long as the run lasts, so a short run can still pass
  the SLO there; a run that is not steady fails.
- A **point** is one run per seed at one rate (the same seeds for every deployment); its
  attainment is the mean over seeds, and it fails when that mean is below 90 % or any of
  its runs is not steady.
- A point whose runs were too short (it would pass but for bursts) measured too little,
  not too much: its deployment runs that rate again with twice the arrivals (new prompts),
  up to `max_span_doublings` times, and only the longest point counts (the shorter ones
  are kept in `remeasured`).
- The **search**, per deployment: from `start_rate`, double while the point passes (up to
  `max_rate`) or halve while it fails (down to `min_rate`), then bisect between the highest
  passing and the lowest failing rate until (fail - pass) / fail <= `rel_tolerance`, in at
  most `max_points` points. Goodput is `goodput_rate` over all points; per seed, over that
  seed's runs, which gives the spread.
- **Interleaved**: the deployments are searched in rounds; a round gives every deployment
  still searching its next rate and runs seed-major (seed 0 of every deployment, then
  seed 1, ...), so slow drift of the machine hits all deployments alike.

The runs themselves come from an injected `DeploymentRunner`, so this module knows nothing
of HTTP (the CLI, weaver/cli/bench.py, passes one built on `run_benchmark`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # weaver.results imports pydantic (~0.1 s); `weaver --help` registers the CLI, which
    # reads SearchConfig's defaults, so the functions below import it where they use it.
    from weaver.results.goodput import Slo
    from weaver.results.records import RequestRecord, RunResult

# The overload check (see the module docstring).
MAX_OUTSTANDING_SHARE = 0.05
TTFT_GROWTH_FACTOR = 2.0
MIN_TTFT_GROWTH_S = 0.05
TTFT_GROWTH_OF_TARGET = 0.25
# Of the first-to-last growth, the share the middle third must already show. Measured: in
# the compute-bound Azure-conv runs 2-3 at 1.2 req/s, `auto`'s seed 2 read thirds of 1.30,
# 0.89, 5.66 s and failed, while dedicated's 3.09, 0.92, 5.73 s passed because its first
# third was already high: the same end-of-run burst of long prompts in both
# (benchmarks/README.md, "The compute-bound regime").
MIDDLE_SHARE_OF_GROWTH = 0.25
# A run's measured arrivals must span this many times their median lifetime. Measured: a
# KV-bound weaving pair "passed" at 3.2 and 4.0 req/s with runs whose 27 measured arrivals
# spanned 6-12 s while each request lived 13-22 s: the whole run fit in its KV at once
# (benchmarks/HISTORY.md, "Goodput: runs 4-6", run 6).
MIN_SPAN_LIFETIMES = 3.0

_NO_ITL = {"records": {"__all__": {"itl_s"}}}

DeploymentRunner = Callable[[str, float, int, int, int], "RunResult"]
"""(label, rate in req/s, workload seed, prompt salt, number of requests) -> that run's
result. The same (rate, seed, number) is the same workload on every deployment."""


@dataclass
class SearchConfig:
    slo: Slo
    seeds: tuple[int, ...] = (0, 1, 2)
    num_requests: int = 200  # per run, warm-up included (at least)
    warmup_requests: int | None = None  # None: 10 % of num_requests
    # A run's arrivals span at least this (s): it sends max(num_requests, rate x this).
    min_span_s: float = 0.0
    start_rate: float = 1.0  # req/s
    min_rate: float = 0.125
    max_rate: float = 64.0
    rel_tolerance: float = 0.05
    max_points: int = 12  # per deployment; a point is len(seeds) runs
    drain_s: float = 30.0  # a run's deadline is its last arrival + this
    # Prompt salts are salt_base + 1, + 2, ... None: drawn per search, so that a second
    # search against a server that stayed up finds none of its prompts in the prefix cache.
    salt_base: int | None = None
    # Judge the runs by this model's requests alone (the others are sent all the same:
    # a hot model's goodput beside a cold model's steady load); None: every request.
    judged_model: str | None = None
    # How many times a point that failed only by bursts is run again, each time with twice
    # the arrivals; 0: a burst fails the point.
    max_span_doublings: int = 2

    def __post_init__(self) -> None:
        self.seeds = tuple(int(seed) for seed in self.seeds)
        if not self.seeds:
            raise ValueError("the search needs at least one seed (--seeds 0 1 2)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds repeat in {list(self.seeds)}; give each seed once")
        if self.num_requests < 2:
            raise ValueError(f"--num-requests must be >= 2 per run, got {self.num_requests}")
        if self.warmup_requests is None:
            self.warmup_requests = self.num_requests // 10
        if not 0 <= self.warmup_requests < self.num_requests:
            raise ValueError(
                f"--warmup-requests must be >= 0 and below --num-requests "
                f"({self.num_requests}), got {self.warmup_requests}"
            )
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate < math.inf:
            raise ValueError(
                "the rates must satisfy 0 < --min-rate <= --start-rate <= --max-rate, got "
                f"{self.min_rate}, {self.start_rate}, {self.max_rate} req/s"
            )
        if not 0 < self.rel_tolerance < 1:
            raise ValueError(f"--rel-tolerance must be in (0, 1), got {self.rel_tolerance}")
        if self.max_points < 1:
            raise ValueError(f"--max-points must be >= 1, got {self.max_points}")
        if not self.min_span_s >= 0:
            raise ValueError(f"--min-span-s must be >= 0 s, got {self.min_span_s}")
        if not self.drain_s > 0:
            raise ValueError(f"--drain-s must be > 0 s, got {self.drain_s}")
        if self.max_span_doublings < 0:
            raise ValueError(f"--max-span-doublings must be >= 0, got {self.max_span_doublings}")
        if self.salt_base is None:
            # Spaced by 1000: two searches' salts meet only past 1000 runs.
            self.salt_base = random.SystemRandom().randrange(1, 2**31) * 1000

    def num_requests_at(self, rate: float, span_doublings: int = 0) -> int:
        """Requests in one run at `rate`: enough that their arrivals span min_span_s, twice
        as many for each time a burst asked for a longer run."""
        return max(self.num_requests, math.ceil(rate * self.min_span_s)) * 2 ** span_doublings

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["slo"] = self.slo.to_json()
        data["seeds"] = list(self.seeds)
        return data


@dataclass(frozen=True)
class RunVerdict:
    """One run judged: attainment over its measured requests and whether it was steady."""

    seed: int
    attainment: float
    num_measured: int
    outstanding_share: float  # measured requests unfinished or not sent at the deadline
    ttft_first_s: float | None  # median TTFT of the first third of measured, by arrival
    ttft_last_s: float | None  # ... and of the last third
    ttft_middle_s: float | None = None  # ... and of the middle one
    # Why the run measured a drain or a burst; None: a steady state.
    overload: str | None = None
    # Not steady only because its arrivals were too few to show a queue (a burst).
    is_burst: bool = False

    @property
    def overloaded(self) -> bool:
        return self.overload is not None


def measured_records(records: Sequence[RequestRecord], warmup: int) -> list[RequestRecord]:
    """The records after the first `warmup` arrivals, in arrival order."""
    ordered = sorted(records, key=lambda r: (r.scheduled_at_s, r.request_id))
    if len(ordered) <= warmup:
        raise ValueError(
            f"a run of {len(ordered)} requests leaves none to measure after {warmup} warm-up "
            "requests; raise --num-requests or lower --warmup-requests"
        )
    return ordered[warmup:]


def judge_run(run: RunResult, seed: int, config: SearchConfig) -> RunVerdict:
    from weaver.results.goodput import attainment
    from weaver.results.records import RequestStatus

    assert config.warmup_requests is not None  # set by __post_init__
    measured = measured_records(run.records, config.warmup_requests)
    if config.judged_model is not None:
        measured = [r for r in measured if r.model == config.judged_model]
        if not measured:
            raise ValueError(f"no measured request of --judged-model {config.judged_model!r}; "
                             "name one of the --model names")
    cut = (RequestStatus.UNFINISHED, RequestStatus.NOT_SENT)
    outstanding = sum(r.status in cut for r in measured) / len(measured)
    third = len(measured) // 3
    first = _median_ttft(measured[:third])
    middle = _median_ttft(measured[third : len(measured) - third]) if third else None
    last = _median_ttft(measured[len(measured) - third :]) if third else None
    overload, is_burst = None, False
    if outstanding > MAX_OUTSTANDING_SHARE:
        overload = (f"seed {seed}: {100 * outstanding:.0f} % of the measured requests were "
                    "outstanding at the deadline")
    elif (first is not None and middle is not None and last is not None
          and _ttft_grows(first, middle, last, config.slo)):
        overload = (f"seed {seed}: median TTFT grew from {1000 * first:.0f} ms (first third) "
                    f"through {1000 * middle:.0f} ms to {1000 * last:.0f} ms (last third)")
    else:
        overload = _burst(measured, seed)
        is_burst = overload is not None
    return RunVerdict(
        seed=seed,
        attainment=attainment(measured, config.slo),
        num_measured=len(measured),
        outstanding_share=outstanding,
        ttft_first_s=first,
        ttft_last_s=last,
        ttft_middle_s=middle,
        overload=overload,
        is_burst=is_burst,
    )


def _burst(measured: Sequence[RequestRecord], seed: int) -> str | None:
    """Why the measured arrivals were too few to show a queue; None when they spanned
    MIN_SPAN_LIFETIMES of their median lifetime."""
    lifetimes = [r.e2e_s for r in measured if r.e2e_s is not None]
    if len(measured) < 2 or not lifetimes:
        return None
    span = measured[-1].scheduled_at_s - measured[0].scheduled_at_s
    lifetime = statistics.median(lifetimes)
    if span >= MIN_SPAN_LIFETIMES * lifetime:
        return None
    return (f"seed {seed}: its measured arrivals spanned {span:.1f} s, under "
            f"{MIN_SPAN_LIFETIMES:g}x their median lifetime ({lifetime:.1f} s): a burst, not "
            "a steady state (raise --min-span-s)")


def _median_ttft(records: Sequence[RequestRecord]) -> float | None:
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return statistics.median(ttfts) if ttfts else None


def _ttft_grows(first_s: float, middle_s: float, last_s: float, slo: Slo) -> bool:
    # The absolute margin keeps jitter on a millisecond TTFT from reading as growth; with no
    # TTFT target (a TPOT-only SLO) the floor alone applies.
    target_share = 0.0 if math.isinf(slo.ttft_s) else TTFT_GROWTH_OF_TARGET * slo.ttft_s
    margin = max(MIN_TTFT_GROWTH_S, target_share)
    growth = last_s - first_s
    return (last_s > TTFT_GROWTH_FACTOR * first_s and growth > margin
            and middle_s - first_s >= MIDDLE_SHARE_OF_GROWTH * growth)


@dataclass
class Point:
    """One deployment at one rate: a run per seed."""

    label: str
    rate: float
    verdicts: list[RunVerdict]  # in the order of SearchConfig.seeds
    run_indices: list[int]  # into SearchOutcome.runs, same order

    @property
    def attainments(self) -> list[float]:
        return [v.attainment for v in self.verdicts]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.attainments)

    @property
    def overloaded(self) -> bool:
        # Any: an overloaded run's attainment is that of a drain, and it would lift the mean.
        return any(v.overloaded for v in self.verdicts)

    @property
    def passed(self) -> bool:
        from weaver.results.goodput import passes

        return passes(self.mean) and not self.overloaded

    @property
    def failed_by_bursts_alone(self) -> bool:
        """Failed, but would pass were its bursts steady: it needs longer runs."""
        from weaver.results.goodput import passes

        reasons = [v for v in self.verdicts if v.overloaded]
        return (not self.passed and bool(reasons) and all(v.is_burst for v in reasons)
                and passes(self.mean))

    def describe(self) -> str:
        shares = self.attainments
        text = (f"{self.label} @ {self.rate:.4g} req/s: attainment {100 * self.mean:.1f} % "
                f"(min {100 * min(shares):.1f}, max {100 * max(shares):.1f}) "
                f"{'pass' if self.passed else 'FAIL'}")
        reasons = [v.overload for v in self.verdicts if v.overload]
        return text + (f" (not steady: {'; '.join(reasons)})" if reasons else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "rate": self.rate,
            "seeds": [v.seed for v in self.verdicts],
            "attainment": self.attainments,
            "mean": self.mean,
            "min": min(self.attainments),
            "max": max(self.attainments),
            "overloaded": [v.overloaded for v in self.verdicts],
            "overload": [v.overload for v in self.verdicts],
            "outstanding_share": [v.outstanding_share for v in self.verdicts],
            "ttft_first_third_s": [v.ttft_first_s for v in self.verdicts],
            "ttft_middle_third_s": [v.ttft_middle_s for v in self.verdicts],
            "ttft_last_third_s": [v.ttft_last_s for v in self.verdicts],
            "pass": self.passed,
            "runs": self.run_indices,
        }


def _goodput_share(attainment_share: float, overloaded: bool) -> float:
    """What a point or run enters goodput_rate with: an overloaded one as a failure."""
    return 0.0 if overloaded else attainment_share


def next_rate(points: Sequence[Point], config: SearchConfig) -> float | None:
    """One deployment's next rate to test, or None when its search is over."""
    if len(points) >= config.max_points:
        return None
    if not points:
        return config.start_rate
    passing = sorted(p.rate for p in points if p.passed)
    failing = sorted(p.rate for p in points if not p.passed)
    if not failing:
        top = passing[-1]
        return None if top >= config.max_rate else min(2 * top, config.max_rate)
    high = failing[0]
    below = [rate for rate in passing if rate < high]
    if not below:
        return None if high <= config.min_rate else max(high / 2, config.min_rate)
    low = below[-1]  # nothing was tested between low and high: the midpoint is new
    if (high - low) / high <= config.rel_tolerance:
        return None
    return (low + high) / 2


@dataclass
class SearchOutcome:
    """What a search measured so far; `complete` once every deployment's search ended."""

    labels: list[str]  # the first is the baseline
    config: SearchConfig
    points: list[Point] = field(default_factory=list)
    runs: list[RunResult] = field(default_factory=list)
    complete: bool = False
    # Points that failed only by bursts and were run again longer: kept, not counted.
    remeasured: list[Point] = field(default_factory=list)

    def points_of(self, label: str) -> list[Point]:
        return [p for p in self.points if p.label == label]

    def goodput(self, label: str) -> float | None:
        """None until the deployment has a point."""
        from weaver.results.goodput import goodput_rate

        mine = self.points_of(label)
        if not mine:
            return None
        return goodput_rate((p.rate, _goodput_share(p.mean, p.overloaded)) for p in mine)

    def seed_goodputs(self, label: str) -> dict[int, float]:
        from weaver.results.goodput import goodput_rate

        mine = self.points_of(label)
        if not mine:
            return {}
        return {
            seed: goodput_rate(
                (p.rate, _goodput_share(p.verdicts[i].attainment, p.verdicts[i].overloaded))
                for p in mine
            )
            for i, seed in enumerate(self.config.seeds)
        }

    def capped(self, label: str) -> bool:
        """True when the deployment passed at the highest rate it was tested at (--max-rate,
        or the last before --max-points ran out): its goodput is a lower bound."""
        mine = self.points_of(label)
        return bool(mine) and max(mine, key=lambda p: p.rate).passed

    def ratios(self) -> dict[str, dict[str, Any]]:
        """Each deployment's goodput over the baseline's: pooled (goodput over mean
        attainments) and seed-paired (a seed's goodput over the baseline's at that seed)."""
        base = self.labels[0]
        base_all, base_seeds = self.goodput(base), self.seed_goodputs(base)
        out = {}
        for label in self.labels[1:]:
            mine, seeds = self.goodput(label), self.seed_goodputs(label)
            paired = {
                seed: _ratio(seeds.get(seed), base_seeds.get(seed)) for seed in self.config.seeds
            }
            known = [r for r in paired.values() if r is not None]
            out[label] = {
                "baseline": base,
                "pooled": _ratio(mine, base_all),
                "per_seed": {str(seed): r for seed, r in paired.items()},
                "min": min(known, default=None),
                "max": max(known, default=None),
            }
        return out

    def verdict(self) -> str:
        base = self.labels[0]
        ratios = self.ratios()
        parts = []
        for label in self.labels[1:] or [base]:
            rate = self.goodput(label)
            if rate is None:
                parts.append(f"{label}: not measured yet")
                continue
            text = f"{label}: goodput {self._rate_text(label, rate)}"
            if label == base:
                seeds = self.seed_goodputs(label).values()
                text += f" (seed range {min(seeds):.3g}-{max(seeds):.3g} req/s)"
            elif ratios[label]["pooled"] is None:
                text += f", {base} has none to compare with"
            else:
                ratio = ratios[label]
                spread = ("" if ratio["min"] is None else
                          f" (seed range {ratio['min']:.2f}-{ratio['max']:.2f}x)")
                text += f" = {ratio['pooled']:.2f}x {base}{spread}"
            parts.append(text)
        slo = self.config.slo.describe()
        state = "" if self.complete else f"search incomplete ({len(self.points)} points): "
        return f"{state}{'; '.join(parts)} at {slo}"

    def _rate_text(self, label: str, rate: float) -> str:
        if self.capped(label):
            return f">= {rate:.3g} req/s (passes at the highest rate tested)"
        if rate == 0.0:
            return f"0 req/s (fails at {min(p.rate for p in self.points_of(label)):.3g} req/s)"
        return f"{rate:.3g} req/s"

    def to_json(self, command: Sequence[str]) -> dict[str, Any]:
        """The results file; it opens with its verdict and ends with every run's records."""
        from weaver.results.records import SCHEMA_VERSION, machine_info, utc_now

        goodput = {}
        for label in self.labels:
            seeds = self.seed_goodputs(label)
            goodput[label] = {
                "rate": self.goodput(label),
                "per_seed": {str(seed): rate for seed, rate in seeds.items()},
                "min": min(seeds.values(), default=None),
                "max": max(seeds.values(), default=None),
                "lower_bound": self.capped(label),
                "num_points": len(self.points_of(label)),
            }
        return {
            "verdict": self.verdict(),
            "goodput": goodput,
            "ratios": self.ratios(),
            "slo": self.config.slo.to_json(),
            "search": {**self.config.to_json(), "labels": self.labels,
                       "complete": self.complete},
            "points": [p.to_json() for p in self.points],
            "remeasured_points": [p.to_json() for p in self.remeasured],
            "command": list(command),
            "machine": machine_info(),
            # With these two and `runs`, `weaver bench summary/plot` read this file too.
            "schema_version": SCHEMA_VERSION,
            "created_at": utc_now(),
            # Each request's streamed gaps (itl_s) are left out: the summaries keep their
            # statistics, and they would make a search's file ten times larger.
            "runs": [run.model_dump(mode="json", exclude=_NO_ITL) for run in self.runs],
        }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def search_goodput(
    labels: Sequence[str],
    runner: DeploymentRunner,
    config: SearchConfig,
    *,
    on_point: Callable[[SearchOutcome], None] | None = None,
    show_progress: bool = True,
) -> SearchOutcome:
    """Search every deployment's goodput, interleaved; `on_point` sees the outcome after
    each new point (the CLI saves it there, so a cut search keeps what it measured)."""
    from tqdm.auto import tqdm

    labels = list(labels)
    if not labels:
        raise ValueError("the search needs at least one deployment")
    if len(set(labels)) != len(labels):
        raise ValueError(f"deployment labels repeat in {labels}; give each its own")
    outcome = SearchOutcome(labels, config)
    salts: dict[tuple[float, int, int], int] = {}
    doublings: dict[tuple[str, float], int] = {}  # (label, rate): a burst's longer runs
    bound = len(labels) * len(config.seeds) * (config.max_points + config.max_span_doublings)
    with tqdm(total=bound, desc="goodput runs (at most)", disable=not show_progress) as bar:
        while True:
            plan = {label: next_rate(outcome.points_of(label), config) for label in labels}
            plan = {label: rate for label, rate in plan.items() if rate is not None}
            if not plan:
                break
            verdicts: dict[str, list[tuple[RunVerdict, int]]] = {label: [] for label in plan}
            for seed in config.seeds:  # seed-major: drift hits every deployment alike
                for label, rate in plan.items():
                    # The same (rate, seed, length) sends the same prompts to every
                    # deployment, and no prompt twice to one: a repeat would be served from
                    # its prefix cache (a longer run again at a rate gets new ones).
                    assert config.salt_base is not None  # set by __post_init__
                    times = doublings.get((label, rate), 0)
                    salt = salts.setdefault((rate, seed, times),
                                            config.salt_base + len(salts) + 1)
                    run = runner(label, rate, seed, salt, config.num_requests_at(rate, times))
                    outcome.runs.append(run)
                    verdicts[label].append((judge_run(run, seed, config), len(outcome.runs) - 1))
                    bar.update(1)
            for label, rate in plan.items():
                point = Point(label, rate, [v for v, _ in verdicts[label]],
                              [i for _, i in verdicts[label]])
                times = doublings.get((label, rate), 0)
                if point.failed_by_bursts_alone and times < config.max_span_doublings:
                    doublings[label, rate] = times + 1
                    outcome.remeasured.append(point)
                    bar.write(f"{point.describe()}: running it again with "
                              f"{config.num_requests_at(rate, times + 1)} requests a run")
                    continue  # next_rate gives the same rate again: this point is not counted
                outcome.points.append(point)
                bar.write(point.describe())  # above the bar, which stays at the bottom
                if on_point is not None:
                    on_point(outcome)
        bar.total = bar.n  # the search ended below its bound
        bar.refresh()
    outcome.complete = True
    return outcome


def saved_runs(report: Mapping[str, Any]) -> list[RunResult]:
    """The runs of a search's results file, parsed (once: they hold every request)."""
    from weaver.results.records import RunResult

    return [RunResult.model_validate(run) for run in report["runs"]]


def regrade(report: Mapping[str, Any], slo: Slo,
            runs: list[RunResult] | None = None) -> SearchOutcome:
    """A search's runs judged again against another SLO, at the rates the search tested
    (so a looser SLO's goodput may be a lower bound: `capped`); how much a ratio owes to
    the choice of SLO. `runs`: the report's, already parsed (`saved_runs`)."""
    search = dict(report["search"])
    labels = search.pop("labels")
    search.pop("complete", None)
    search["slo"] = slo
    config = SearchConfig(**search)
    runs = saved_runs(report) if runs is None else runs
    outcome = SearchOutcome(labels, config, runs=runs, complete=True)
    for point in report["points"]:
        verdicts = [judge_run(runs[i], seed, config)
                    for i, seed in zip(point["runs"], point["seeds"], strict=True)]
        outcome.points.append(Point(point["label"], point["rate"], verdicts, point["runs"]))
    return outcome


def goodput_grid(report: Mapping[str, Any], ttft_slo_ms: Sequence[float],
                 tpot_slo_ms: Sequence[float],
                 runs: list[RunResult] | None = None) -> dict[str, Any]:
    """Each deployment's goodput and ratio under every (TTFT, TPOT) target pair, from one
    search's runs (`regrade`); a verdict that gives the range of each ratio over the grid,
    then a printable table, then the grid."""
    from weaver.results.goodput import Slo

    runs = saved_runs(report) if runs is None else runs
    cells = []
    for ttft_ms in ttft_slo_ms:
        for tpot_ms in tpot_slo_ms:
            outcome = regrade(report, Slo.from_ms(ttft_ms=ttft_ms, tpot_ms=tpot_ms), runs)
            ratios = outcome.ratios()
            cells.append({
                "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms},
                "goodput": {label: {"rate": outcome.goodput(label),
                                    "lower_bound": outcome.capped(label)}
                            for label in outcome.labels},
                "ratios": {label: {key: ratio[key] for key in ("pooled", "min", "max")}
                           for label, ratio in ratios.items()},
            })
    labels = list(report["search"]["labels"])
    base, others = labels[0], labels[1:]
    parts = []
    for label in others:
        pooled = [c["ratios"][label]["pooled"] for c in cells]
        known = [r for r in pooled if r is not None]
        text = (f"{label}: {min(known):.2f}-{max(known):.2f}x {base}" if known
                else f"{label}: no ratio")
        if len(known) < len(pooled):
            text += (f" ({len(pooled) - len(known)} of {len(pooled)} SLOs without a ratio: "
                     f"{base} failed at the lowest rate tested)")
        parts.append(text)
    verdict = (f"over {len(cells)} SLOs (TTFT {', '.join(f'{t:g}' for t in ttft_slo_ms)} ms "
               f"x TPOT {', '.join(f'{t:g}' for t in tpot_slo_ms)} ms): " + "; ".join(parts))
    header = "TTFT ms  TPOT ms  " + "  ".join(f"{label:>20}" for label in labels)
    table = [header]
    for cell in cells:
        texts = []
        for label in labels:
            found = cell["goodput"][label]
            rate = found["rate"]
            if rate is None:
                text = "-"
            elif rate == 0:  # failed at every rate tested
                text = f"<{min(p['rate'] for p in report['points'] if p['label'] == label):.3g}"
            else:
                text = f"{'>=' if found['lower_bound'] else ''}{rate:.3g}"
            ratio = cell["ratios"].get(label, {}).get("pooled")
            if ratio is not None:
                text += f" ({ratio:.2f}x)"
            texts.append(f"{text:>20}")
        table.append(f"{cell['slo']['ttft_ms']:>7g}  {cell['slo']['tpot_ms']:>7g}  "
                     + "  ".join(texts))
    return {"verdict": verdict, "table": table, "source_verdict": report.get("verdict"),
            "labels": labels, "grid": cells}


def neighbour_tpot_ratios(report: Mapping[str, Any], model: str,
                          runs: list[RunResult] | None = None) -> dict[str, dict[str, Any]]:
    """Another model's median TPOT under each deployment over the baseline's, per rate the
    two share, its requests pooled over the seeds both ran (a cold model's handful per run
    is too few alone): what weaving costs the model it borrows from. `runs`: the report's,
    already parsed (`saved_runs`)."""
    labels = list(report["search"]["labels"])
    runs = saved_runs(report) if runs is None else runs
    run_of = {(point["label"], point["rate"], seed): runs[index] for point in report["points"]
              for index, seed in zip(point["runs"], point["seeds"], strict=True)}

    def tpots(label: str, rate: float, seeds: list[int]) -> list[float]:
        return [t for seed in seeds for r in run_of[label, rate, seed].records
                if r.model == model and (t := r.tpot_s) is not None]

    out: dict[str, dict[str, Any]] = {}
    for label in labels[1:]:
        for rate in sorted({rate for (other, rate, _) in run_of if other == label}):
            seeds = sorted(seed for (other, r, seed) in run_of if other == label and r == rate
                           and (labels[0], rate, seed) in run_of)
            mine, base = tpots(label, rate, seeds), tpots(labels[0], rate, seeds)
            if mine and base:
                out.setdefault(label, {})[str(rate)] = {
                    "ratio": statistics.median(mine) / statistics.median(base),
                    "num_requests": len(mine), "seeds": seeds}
    return out


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write `SearchOutcome.to_json`'s results (keys stay in their order: verdict first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return path
