"""Validate the simulator against measured `weaver bench` runs.

For every run of a saved `BenchResult` (one deployment at one rate), the measured requests
are replayed in a simulated copy of that deployment (`weaver.sim.deployment`), and the
simulated requests are summarised by the benchmark's own `weaver.results.metrics.summarize`.
Mean TPOT and output-token throughput per model (and, when asked, mean TTFT) are compared
as sim / measured; a number is within tolerance when |ratio - 1| <= tolerance (15 % by
default).

Several results files of the same workload (repeats of one `weaver bench compare`) are
validated together: each measured run is replayed on its own, and for every deployment and
rate the mean of the simulated numbers is compared with the mean of the measured ones. The
measured runs' own spread ((max - min) / mean) is reported beside each number, because on a
machine whose speed drifts a one-run reference can miss by more than the tolerance on its
own.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from weaver.config.deployment import Deployment
from weaver.results.records import ALL_MODELS, BenchResult, ModelSummary, RunResult
from weaver.sim.deployment import sim_config_from_deployment
from weaver.sim.metrics import bench_record, bench_summary
from weaver.sim.runner import simulate
from weaver.sim.workload import replay_run

DEFAULT_TOLERANCE = 0.15
METRICS = ("mean_tpot_s", "output_tokens_per_s")  # compared by default
ALL_METRICS = ("mean_ttft_s", *METRICS)


@dataclass(frozen=True)
class Comparison:
    label: str
    rate: float | None
    model: str
    metric: str
    measured: float | None
    simulated: float | None
    tolerance: float
    # Each repeat's own numbers, one per run; `measured` and `simulated` are their means.
    measured_runs: tuple[float, ...] = field(default=())
    simulated_runs: tuple[float, ...] = field(default=())

    @property
    def ratio(self) -> float | None:
        if not self.measured or self.simulated is None:
            return None
        return self.simulated / self.measured

    @property
    def measured_spread(self) -> float | None:
        """(max - min) / mean of the measured repeats; 0 for one run."""
        if not self.measured or not self.measured_runs:
            return None
        return (max(self.measured_runs) - min(self.measured_runs)) / self.measured

    @property
    def is_within(self) -> bool:
        ratio = self.ratio
        return ratio is not None and abs(ratio - 1.0) <= self.tolerance + 1e-12

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "is_within": self.is_within,
                "measured_spread": self.measured_spread}


def metric_values(summary: ModelSummary) -> dict[str, float | None]:
    return {"mean_ttft_s": summary.ttft.mean if summary.ttft else None,
            "mean_tpot_s": summary.tpot.mean if summary.tpot else None,
            "output_tokens_per_s": summary.output_token_throughput}


def deployment_paths_from_command(result: BenchResult) -> dict[str, Path]:
    """Deployment files named in the benchmark's command, by label (their file stem, as
    `weaver bench compare` labels them; `--target LABEL=PATH` too)."""
    out = {}
    for arg in result.command:
        label, sep, value = arg.partition("=")
        path = Path(value if sep else arg)
        if path.suffix in (".yaml", ".yml"):
            out[label.strip() if sep else path.stem] = path
    return out


def simulate_run(run: RunResult, deployment: Deployment,
                 profiles: Mapping[str, str], contended_speed: float = 1.0) -> dict:
    """Replay one measured run in the simulator: its policy, sim stats and summaries."""
    requests = replay_run(run)
    config = sim_config_from_deployment(deployment, profiles, requests, name=run.label,
                                        contended_speed=contended_speed)
    sim = simulate(config, requests=requests, keep_requests=True)
    records = [bench_record(r) for r in sim["requests"]]
    return {"policy": sim["policy"], "sim": sim["sim"], "summary": bench_summary(records),
            "records": records}


def validate_runs(runs: Sequence[RunResult], deployment: Deployment,
                  profiles: Mapping[str, str], tolerance: float = DEFAULT_TOLERANCE,
                  contended_speed: float = 1.0, metrics: Sequence[str] = METRICS) -> dict:
    """Replay repeats of one deployment at one rate; compare the means of their summaries."""
    first = runs[0]
    for run in runs[1:]:
        if _setting(run.workload) != _setting(first.workload):
            raise ValueError(f"runs of {first.label!r} at rate {first.rate} have different "
                             "workloads; repeats must come from the same benchmark command")
    replays = [simulate_run(run, deployment, profiles, contended_speed) for run in runs]
    comparisons = []
    for model in sorted(first.summary):
        if not all(model in run.summary and model in rep["summary"]
                   for run, rep in zip(runs, replays, strict=True)):
            continue
        for metric in metrics:
            measured = [metric_values(run.summary[model])[metric] for run in runs]
            simulated = [metric_values(rep["summary"][model])[metric] for rep in replays]
            comparisons.append(Comparison(
                first.label, first.rate, model, metric, _mean(measured), _mean(simulated),
                tolerance, measured_runs=tuple(measured) if None not in measured else (),
                simulated_runs=tuple(simulated) if None not in simulated else ()))
    return {"label": first.label, "rate": first.rate, "policy": replays[0]["policy"],
            "num_runs": len(runs),
            "sim_summaries": [{m: s.model_dump() for m, s in rep["summary"].items()}
                              for rep in replays],
            "sims": [rep["sim"] for rep in replays],
            "comparisons": [c.to_dict() for c in comparisons]}


def _setting(workload: Mapping) -> dict:
    """A run's workload without what its seed draws: runs of one (deployment, rate) at
    several seeds (a goodput search's) are compared by their means, each replayed alone."""
    return {k: v for k, v in workload.items() if k not in ("seed", "requests")}


class GoodputJudge(Protocol):
    """What judges a search's runs (the bench's `regrade`, bound to its results file)."""

    def __call__(self, runs: list[RunResult]) -> Any: ...


def validate_goodput(search: Mapping, runs: list[RunResult], judge: GoodputJudge,
                     deployments: Mapping[str, Deployment], profiles: Mapping[str, str],
                     tolerance: float = DEFAULT_TOLERANCE,
                     label_profiles: Mapping[str, Mapping[str, str]] | None = None,
                     contended_speed: float = 1.0) -> dict:
    """A `weaver bench goodput` search replayed: each of its `runs` in a simulated copy of
    its deployment, then the measured and the simulated runs judged alike by `judge` (the
    search's own: its SLO, warm-up, queue-growth and burst rules, seeds pooled; its outcome
    answers `goodput(label)` and `seed_goodputs(label)`), so each deployment's goodput is
    compared as sim / measured. `search`: the results file's `search` section."""
    label_profiles = label_profiles or {}
    missing = sorted({run.label for run in runs} - set(deployments))
    if missing:
        raise ValueError(f"no deployment file for run label(s) {missing}; pass "
                         "--deployment LABEL=PATH")
    simulated_runs = [
        run.model_copy(update={"records": simulate_run(
            run, deployments[run.label], {**profiles, **label_profiles.get(run.label, {})},
            contended_speed)["records"]})
        for run in runs]
    measured, simulated = judge(runs), judge(simulated_runs)
    rows = []
    for label in search["labels"]:
        comparison = Comparison(label, None, search.get("judged_model") or ALL_MODELS,
                                "goodput_rps", measured.goodput(label), simulated.goodput(label),
                                tolerance,
                                measured_runs=tuple(measured.seed_goodputs(label).values()),
                                simulated_runs=tuple(simulated.seed_goodputs(label).values()))
        rows.append(comparison.to_dict())
    return {"tolerance": tolerance, "slo": search["slo"], "goodput": rows,
            "num_within": sum(r["is_within"] for r in rows), "num_checked": len(rows)}


def validate_results(results: Sequence[BenchResult], deployments: Mapping[str, Deployment],
                     profiles: Mapping[str, str],
                     tolerance: float = DEFAULT_TOLERANCE,
                     label_profiles: Mapping[str, Mapping[str, str]] | None = None,
                     contended_speed: float = 1.0, metrics: Sequence[str] = METRICS) -> dict:
    """Validate every (deployment, rate) of one or more results files of the same workload;
    repeats of a (deployment, rate) are compared by their means. `profiles` maps a model to
    its profile; `label_profiles[label]` overrides that for one deployment's models (its
    engines may run on other cores: a mux group's on all of the group's).
    `contended_speed`: a mux group's step speed while its other engine has work;
    `metrics`: which of ALL_METRICS to compare."""
    unknown = sorted(set(metrics) - set(ALL_METRICS))
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {list(ALL_METRICS)}")
    groups: dict[tuple[str, float | None], list[RunResult]] = {}
    for result in results:
        for run in result.runs:
            groups.setdefault((run.label, run.rate), []).append(run)
    missing = sorted({label for label, _ in groups} - set(deployments))
    if missing:
        raise ValueError(f"no deployment file for run label(s) {missing}; pass "
                         "--deployment LABEL=PATH")
    label_profiles = label_profiles or {}
    runs = [validate_runs(group, deployments[label],
                          {**profiles, **label_profiles.get(label, {})}, tolerance,
                          contended_speed, metrics)
            for (label, _), group in groups.items()]
    checked = [c for r in runs for c in r["comparisons"] if c["model"] != ALL_MODELS]
    noisy = [c for c in checked
             if c["measured_spread"] is not None and c["measured_spread"] > tolerance]
    return {"tolerance": tolerance, "profiles": dict(profiles),
            "label_profiles": {k: dict(v) for k, v in label_profiles.items()},
            "mux_contended_speed": contended_speed, "runs": runs,
            "num_results": len(results),
            "num_within": sum(c["is_within"] for c in checked), "num_checked": len(checked),
            "num_measured_spread_over_tolerance": len(noisy),
            "all_within": bool(checked) and all(c["is_within"] for c in checked)}


def _mean(values: list[float | None]) -> float | None:
    return statistics.fmean(values) if values and None not in values else None


def format_table(report: dict) -> str:
    repeats = max((r.get("num_runs", 1) for r in report["runs"]), default=1)
    measured = "measured" if repeats == 1 else "meas. mean"
    lines = [f"{'deployment':<12} {'rate':>5} {'model':<8} {'metric':<28} {measured:>10} "
             f"{'sim':>10} {'sim/meas':>8}  within {report['tolerance']:.0%}"
             + ("  runs  meas. spread" if repeats > 1 else "")]
    for run in report["runs"]:
        for c in run["comparisons"]:
            scale, unit = (1.0, "tok/s") if c["metric"] == "output_tokens_per_s" else (1e3, "ms")
            line = (f"{c['label']:<12} {_num(c['rate'], 1):>5} "
                    f"{'all' if c['model'] == ALL_MODELS else c['model']:<8} "
                    f"{c['metric'] + ' (' + unit + ')':<28} {_num(c['measured'], scale):>10} "
                    f"{_num(c['simulated'], scale):>10} {_num(c['ratio'], 1, 3):>8}  "
                    f"{'yes' if c['is_within'] else 'NO':<10}")
            if repeats > 1:
                spread = c.get("measured_spread")
                line += (f"  {run.get('num_runs', 1):>4}  "
                         f"{'-' if spread is None else f'{spread:.0%}':>12}")
            lines.append(line.rstrip())
    summary = (f"{report['num_within']} of {report['num_checked']} per-model numbers within "
               f"{report['tolerance']:.0%}")
    if repeats > 1:
        summary += (f" of the mean of up to {repeats} measured runs; in "
                    f"{report['num_measured_spread_over_tolerance']} of them the measured "
                    f"runs themselves spread by more than {report['tolerance']:.0%}")
    lines.append(summary)
    return "\n".join(lines)


def format_goodput(report: dict, source: str) -> str:
    """The goodput comparison of one search's results file (`validate_goodput`)."""
    slo = report["slo"]
    lines = [f"goodput of {source} (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} "
             "ms, the search's judge):",
             f"{'deployment':<20} {'measured':>9} {'sim':>9} {'sim/meas':>8}  "
             f"within {report['tolerance']:.0%}  per seed (measured / sim)"]
    for c in report["goodput"]:
        seeds = ", ".join(f"{m:g}/{s:g}" for m, s in zip(c["measured_runs"],
                                                          c["simulated_runs"], strict=False))
        lines.append(f"{c['label']:<20} {_num(c['measured'], 1):>9} {_num(c['simulated'], 1):>9} "
                     f"{_num(c['ratio'], 1, 3):>8}  {'yes' if c['is_within'] else 'NO':<10}  "
                     f"{seeds}")
    lines.append(f"{report['num_within']} of {report['num_checked']} goodputs within "
                 f"{report['tolerance']:.0%}")
    return "\n".join(lines)


def _num(value: float | None, scale: float, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"
