"""PNG plots drawn only from saved result JSON (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out_png: str | Path) -> Path:
    """Write the figure as a PNG and free it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def plot_run(result_json: str | Path, out_png: str | Path) -> Path:
    """Per-model p50/p90 TTFT and TPOT of one simulation."""
    result = json.loads(Path(result_json).read_text())
    summary = {k: v for k, v in result["summary"].items() if k != "_all"}
    models = [m for m, s in summary.items() if s["num_completed"]][:40]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(models) * 0.4 + 4), 4))
    for ax, metric, scale, unit in ((axes[0], "ttft_s", 1, "s"), (axes[1], "tpot_s", 1e3,
                                                                        "ms")):
        for offset, q in ((-0.2, "p50"), (0.2, "p90")):
            values = [(summary[m][metric][q] or 0) * scale for m in models]
            ax.bar([i + offset for i in range(len(models))], values, width=0.4, label=q)
        ax.set_xticks(range(len(models)), models, rotation=90)
        ax.set_ylabel(f"{metric.split('_')[0].upper()} ({unit})")
        ax.legend()
    fig.suptitle(f"{result['config']} / {result['policy']}")
    return _save(plt, fig, out_png)


def plot_sweep(sweep_json: str | Path, out_png: str | Path) -> Path:
    """Token throughput and p90 TPOT of the swept model against its rate, per policy."""
    sweep = json.loads(Path(sweep_json).read_text())
    model = sweep["model"]
    plt = _pyplot()
    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in sorted({p["policy"] for p in sweep["points"]}):
        points = [p for p in sweep["points"] if p["policy"] == policy]
        rates = [p["rate"] for p in points]
        ax_tp.plot(rates, [p["summary"][model]["output_tokens_per_s"] for p in points], "o-",
                   label=policy)
        ax_tpot.plot(rates, [(p["summary"][model]["tpot_s"]["p90"] or 0) * 1e3
                             for p in points], "o-", label=policy)
    ax_tpot.axhline(sweep["slo"]["tpot_ms"], color="gray", linestyle="--", label="TPOT SLO")
    ax_tp.set(xlabel=f"{model} rate (req/s)", ylabel="output tokens / s")
    ax_tpot.set(xlabel=f"{model} rate (req/s)", ylabel="p90 TPOT (ms)", yscale="log")
    ax_tp.legend()
    ax_tpot.legend()
    fig.suptitle(f"{sweep['config']}: max {model} rate under SLO "
                 + ", ".join(f"{k}={v:.2f}" for k, v in sweep["max_rate_rps"].items()))
    return _save(plt, fig, out_png)


def plot_plan(plan_json: str | Path, out_png: str | Path) -> Path:
    """Simulated goodput and throughput of each planner candidate and the baseline."""
    result = json.loads(Path(plan_json).read_text())
    entries = result["candidates"] + [result["baseline"]]
    labels = [e["label"] for e in entries]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, len(entries) * 1.6), 4.5))
    xs = range(len(entries))
    ax.bar([x - 0.2 for x in xs], [e["summary"]["_all"]["throughput_rps"] for e in entries],
           width=0.4, label="served (completed)")
    ax.bar([x + 0.2 for x in xs], [e["summary"]["_all"]["goodput_rps"] for e in entries],
           width=0.4, label="goodput (within SLO)")
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("requests / s")
    ax.set_title(f"{result['config']}: chosen {result['chosen']['label']}")
    ax.legend()
    return _save(plt, fig, out_png)


def plot_scale(scale_json: str | Path, out_png: str | Path) -> Path:
    """Goodput of each placement against the total request rate (benchmarks/sim_scale.py)."""
    scale = json.loads(Path(scale_json).read_text())
    rates = [p["total_rate"] for p in scale["points"]]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in scale["points"][0]["placements"]:
        ax.plot(rates, [p["placements"][name]["goodput_rps"] for p in scale["points"]],
                marker="o", label=name)  # fmt: skip
    ax.plot(rates, rates, color="grey", linestyle=":", label="offered")
    ax.set_xlabel("total request rate (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"{scale['config']}: {scale['num_models']} models on {scale['num_gpus']} GPUs")
    ax.legend()
    return _save(plt, fig, out_png)
