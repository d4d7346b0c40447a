"""Figures drawn only from saved results files (never from a live run).

- `plot_tpot_vs_rate`: TPOT percentile against offered rate, one panel per model with the
  hot model first and the cold model(s) beside it, one line per deployment: the layout of
  the Weaver paper's Figure 4.
- `plot_throughput_bars`: output-token throughput per deployment, one bar per model.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from weaver.results.records import ALL_MODELS, RunResult, load_result

logger = logging.getLogger(__name__)


def load_runs(paths: Sequence[str | os.PathLike[str]]) -> list[RunResult]:
    if not paths:
        raise ValueError("give at least one results JSON file")
    return [run for path in paths for run in load_result(path).runs]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def ordered_models(runs: Sequence[RunResult]) -> list[str]:
    """Hot model(s) first. Roles come from the results when the deployment recorded them;
    otherwise the model that received the most requests is taken as the hot one."""
    num_requests: dict[str, int] = defaultdict(int)
    roles: dict[str, str] = {}
    for run in runs:
        roles.update(run.roles)
        for model, summary in run.summary.items():
            if model != ALL_MODELS:
                num_requests[model] += summary.num_requests
    return sorted(num_requests, key=lambda m: (roles.get(m, "") != "hot", -num_requests[m], m))


def _role(model: str, index: int, runs: Sequence[RunResult]) -> str:
    for run in runs:
        if model in run.roles:
            return run.roles[model]
    return "hot" if index == 0 else "cold"


def _offered_rate(run: RunResult, model: str) -> float | None:
    rates = run.workload.get("model_rates") or {}
    return rates.get(model, run.rate)


def plot_tpot_vs_rate(
    runs: Sequence[RunResult],
    out_path: str | os.PathLike[str],
    percentile: float = 90.0,
    tpot_slo_s: float | None = None,
) -> Path:
    models = ordered_models(runs)
    if not models:
        raise ValueError("the results hold no model summaries to plot")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    hot = models[0]
    for index, (ax, model) in enumerate(zip(axes[0], models, strict=True)):
        by_label: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for run in runs:
            summary = run.summary.get(model)
            x = _offered_rate(run, hot)
            if summary is None or summary.tpot is None or x is None:
                continue
            by_label[run.label].append((x, 1000.0 * summary.tpot.p(percentile)))
        for label, points in sorted(by_label.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if tpot_slo_s is not None:
            ax.axhline(1000.0 * tpot_slo_s, color="grey", linestyle="--", label="TPOT SLO")
        ax.set_title(f"{_role(model, index, runs)} model: {model}")
        ax.set_xlabel(f"offered rate of {hot} (req/s)")
        ax.set_ylabel(f"p{percentile:g} TPOT (ms)")
        ax.grid(alpha=0.3)
        if by_label:
            ax.legend(fontsize="small")
    return _save(fig, plt, out_path)


def plot_throughput_bars(runs: Sequence[RunResult], out_path: str | os.PathLike[str]) -> Path:
    """Per deployment, each model's best output-token throughput over its runs."""
    models = ordered_models(runs)
    labels = list(dict.fromkeys(run.label for run in runs))
    if not models or not labels:
        raise ValueError("the results hold no runs to plot")
    best: dict[tuple[str, str], float] = defaultdict(float)
    for run in runs:
        for model in models:
            summary = run.summary.get(model)
            if summary is not None:
                key = (run.label, model)
                best[key] = max(best[key], summary.output_token_throughput)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(labels) * len(models)), 3.6))
    width = 0.8 / len(models)
    for index, model in enumerate(models):
        xs = [i + index * width for i in range(len(labels))]
        ax.bar(xs, [best[(label, model)] for label in labels], width, label=model)
    ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("output throughput (tokens/s)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, plt, out_path)


def plot_scraped(runs: Sequence[RunResult], out_path: str | os.PathLike[str]) -> Path:
    """The gauges the runs scraped from /metrics (`--scrape-metric`) over each run's time:
    one panel per series, a line per run, the last arrival marked."""
    keys = list(dict.fromkeys(key for run in runs for key in run.scraped))
    if not keys:
        raise ValueError("the runs scraped no gauge; run them with --scrape-metric")
    plt = _pyplot()
    fig, axes = plt.subplots(len(keys), 1, figsize=(7.0, 1.9 * len(keys)), sharex=True,
                             squeeze=False)
    # A run keeps its colour in every panel, also where another run has no such series.
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, object] = {}  # one legend for the figure, a run once
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for index, run in enumerate(runs):
            points = run.scraped.get(key)
            if not points:
                continue
            rate = "" if run.rate is None else f" @ {run.rate:g} req/s"
            colour = colours[index % len(colours)]
            line, = ax.plot([t for t, _ in points], [v for _, v in points], lw=1, color=colour)
            handles.setdefault(f"{run.label}{rate}", line)
            if run.records:
                ax.axvline(run.last_arrival_s, color=colour, lw=0.6, ls=":")
        ax.set_title(key, fontsize="small", loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds from the run's start (dotted: its last arrival)")
    axes[0, 0].legend(list(handles.values()), list(handles), fontsize="x-small", ncol=2,
                      loc="lower left", bbox_to_anchor=(0.0, 1.15))
    return _save(fig, plt, out_path)


def _save(fig, plt, out_path: str | os.PathLike[str]) -> Path:
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path


def plot_results(
    paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    percentile: float = 90.0,
    tpot_slo_s: float | None = None,
) -> list[Path]:
    """Both figures for the runs in `paths`, written into `out_dir`, and the scraped
    gauges' when the runs have any."""
    runs = load_runs(paths)
    out = Path(out_dir)
    written = [
        plot_tpot_vs_rate(runs, out / "tpot_vs_rate.png", percentile, tpot_slo_s),
        plot_throughput_bars(runs, out / "throughput.png"),
    ]
    if any(run.scraped for run in runs):
        written.append(plot_scraped(runs, out / "scraped.png"))
    return written
