"""The figure of a goodput search, drawn from its results JSON only
(weaver/bench/goodput_search.py writes it): SLO attainment against offered rate, one line
per deployment with min-max bars over the seeds, the 90 % target dashed, points whose runs
were not steady crossed out, and each deployment's goodput dotted and in the legend."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weaver.bench.plots import _pyplot, _save

# A search doubles and halves its rate: past this span of rates a log axis reads better.
LOG_AXIS_SPAN = 8.0


def plot_goodput(report: Mapping[str, Any], out_path: str | os.PathLike[str]) -> Path:
    """`report` is a goodput search's results (its `points`, `goodput` and `slo`)."""
    from weaver.results.goodput import ATTAINMENT_TARGET, Slo

    points = report.get("points") or []
    if not points:
        raise ValueError("the goodput results hold no points to plot; the search measured none")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    goodputs = report.get("goodput") or {}
    labels = list(goodputs or dict.fromkeys(p["label"] for p in points))
    overload_label = "not steady: fails"  # in the legend once
    for label in labels:
        mine = sorted((p for p in points if p["label"] == label), key=lambda p: p["rate"])
        if not mine:
            continue
        found = goodputs.get(label) or {}
        goodput = found.get("rate")
        # passed at the highest rate tested (the key's older name in earlier files)
        at_least = ">= " if found.get("lower_bound", found.get("capped_at_max_rate")) else ""
        text = label if goodput is None else f"{label}: goodput {at_least}{goodput:.3g} req/s"
        rates = [p["rate"] for p in mine]
        means = [100 * p["mean"] for p in mine]
        errors = [[100 * (p["mean"] - p["min"]) for p in mine],
                  [100 * (p["max"] - p["mean"]) for p in mine]]
        line = ax.errorbar(rates, means, yerr=errors, marker="o", capsize=3, label=text)
        if goodput:
            ax.axvline(goodput, color=line.lines[0].get_color(), linestyle=":", alpha=0.8)
        # Overloaded points measured a drain, not a steady state: they fail whatever their
        # attainment, which the marker has to say as the line cannot.
        over = [(p["rate"], 100 * p["mean"]) for p in mine if any(p["overloaded"])]
        if over:
            ax.scatter(*zip(*over, strict=True), marker="x", s=80, color="red", zorder=3,
                       label=overload_label)
            overload_label = None
    ax.axhline(100 * ATTAINMENT_TARGET, color="grey", linestyle="--",
               label=f"{100 * ATTAINMENT_TARGET:.0f} % target")
    rates = [p["rate"] for p in points]
    if max(rates) / min(rates) > LOG_AXIS_SPAN:
        ax.set_xscale("log")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    slo = report.get("slo") or {}
    slo_text = Slo.from_ms(slo.get("ttft_ms"), slo.get("tpot_ms")).describe()
    ax.set_title(f"SLO attainment at {slo_text}", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return _save(fig, plt, out_path)


def plot_goodput_file(
    results_path: str | os.PathLike[str], out_path: str | os.PathLike[str]
) -> Path:
    path = Path(results_path)
    if not path.is_file():
        raise ValueError(f"goodput results file {path} does not exist")
    return plot_goodput(json.loads(path.read_text(encoding="utf-8")), out_path)
