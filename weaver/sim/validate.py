"""Validate the simulator against measured `weaver bench` runs (issue 8, acceptance 1).

For every run of a saved `BenchResult` (one deployment at one rate), the measured requests
are replayed in a simulated copy of that deployment (`weaver.sim.deployment`), and the
simulated requests are summarised by the benchmark's own `weaver.bench.metrics.summarize`.
Mean TPOT and output-token throughput per model are compared as sim / measured; a number
is within tolerance when |ratio - 1| <= tolerance (15 % by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from weaver.bench.results import ALL_MODELS, BenchResult, ModelSummary, RunResult
from weaver.config.deployment import Deployment
from weaver.sim.deployment import sim_config_from_deployment
from weaver.sim.metrics import bench_record, bench_summary
from weaver.sim.runner import simulate
from weaver.sim.workload import replay_run

DEFAULT_TOLERANCE = 0.15
METRICS = ("mean_tpot_s", "output_tokens_per_s")


@dataclass(frozen=True)
class Comparison:
    label: str
    rate: float | None
    model: str
    metric: str
    measured: float | None
    simulated: float | None
    tolerance: float

    @property
    def ratio(self) -> float | None:
        if not self.measured or self.simulated is None:
            return None
        return self.simulated / self.measured

    @property
    def is_within(self) -> bool:
        ratio = self.ratio
        return ratio is not None and abs(ratio - 1.0) <= self.tolerance + 1e-12

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "is_within": self.is_within}


def metric_values(summary: ModelSummary) -> dict[str, float | None]:
    return {"mean_tpot_s": summary.tpot.mean if summary.tpot else None,
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


def validate_run(run: RunResult, deployment: Deployment, profiles: Mapping[str, str],
                 tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Replay one measured run in the simulator; compare its summaries with the run's."""
    requests = replay_run(run)
    config = sim_config_from_deployment(deployment, profiles, requests, name=run.label)
    sim = simulate(config, requests=requests, keep_requests=True)
    simulated = bench_summary([bench_record(r) for r in sim["requests"]])
    comparisons = []
    for model in sorted(run.summary):
        if model not in simulated:
            continue
        measured_values = metric_values(run.summary[model])
        sim_values = metric_values(simulated[model])
        comparisons += [Comparison(run.label, run.rate, model, metric, measured_values[metric],
                                   sim_values[metric], tolerance) for metric in METRICS]
    return {"label": run.label, "rate": run.rate, "policy": sim["policy"],
            "sim_summary": {m: s.model_dump() for m, s in simulated.items()},
            "sim": sim["sim"], "comparisons": [c.to_dict() for c in comparisons]}


def validate_result(result: BenchResult, deployments: Mapping[str, Deployment],
                    profiles: Mapping[str, str],
                    tolerance: float = DEFAULT_TOLERANCE) -> dict:
    missing = sorted({run.label for run in result.runs} - set(deployments))
    if missing:
        raise ValueError(f"no deployment file for run label(s) {missing}; pass "
                         "--deployment LABEL=PATH")
    runs = [validate_run(run, deployments[run.label], profiles, tolerance)
            for run in result.runs]
    checked = [c for r in runs for c in r["comparisons"] if c["model"] != ALL_MODELS]
    return {"tolerance": tolerance, "profiles": dict(profiles), "runs": runs,
            "num_within": sum(c["is_within"] for c in checked), "num_checked": len(checked),
            "all_within": bool(checked) and all(c["is_within"] for c in checked)}


def format_table(report: dict) -> str:
    lines = [f"{'deployment':<12} {'rate':>5} {'model':<8} {'metric':<20} {'measured':>10} "
             f"{'sim':>10} {'sim/meas':>8}  within {report['tolerance']:.0%}"]
    for run in report["runs"]:
        for c in run["comparisons"]:
            scale, unit = (1e3, "ms") if c["metric"] == "mean_tpot_s" else (1.0, "tok/s")
            lines.append(
                f"{c['label']:<12} {_num(c['rate'], 1):>5} "
                f"{'all' if c['model'] == ALL_MODELS else c['model']:<8} "
                f"{c['metric'] + ' (' + unit + ')':<20} {_num(c['measured'], scale):>10} "
                f"{_num(c['simulated'], scale):>10} {_num(c['ratio'], 1, 3):>8}  "
                f"{'yes' if c['is_within'] else 'NO'}")
    lines.append(f"{report['num_within']} of {report['num_checked']} per-model numbers within "
                 f"{report['tolerance']:.0%}")
    return "\n".join(lines)


def _num(value: float | None, scale: float, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"
