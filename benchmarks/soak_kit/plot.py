"""The soak's plot, drawn from soak.json alone: request outcomes per minute, the gateway's RSS,
fds and threads, /dev/shm and vLLM's socket files, and each weaving pair's /health status;
kills are red lines (a band until the engine was back), whole-server restarts grey bands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

OUTCOME_COLORS = {"ok": "tab:blue", "clean": "tab:orange", "no_retry_after": "tab:pink",
                  "server_down": "tab:gray", "lost": "black"}


def _mark_events(axes: list, result: dict[str, Any]) -> None:
    for kill in result["kills"]:
        back = kill["back_at_s"] if kill["back_at_s"] is not None else kill["at_s"] + 5
        for ax in axes:
            ax.axvline(kill["at_s"], color="tab:red", linewidth=0.6)
            ax.axvspan(kill["at_s"], back, color="tab:red", alpha=0.1)
    end = result["samples"][-1]["at_s"] if result["samples"] else 0.0
    for restart in result["server_restarts"]:
        back = restart["back_at_s"] if restart["back_at_s"] is not None else end
        for ax in axes:
            ax.axvspan(restart["at_s"], back, color="tab:gray", alpha=0.3)


def _outcomes(ax, result: dict[str, Any]) -> None:
    bottom = [0] * len(result["outcomes_per_minute"])
    starts = [60 * i for i in range(len(bottom))]
    for kind, color in OUTCOME_COLORS.items():
        counts = [minute[kind] for minute in result["outcomes_per_minute"]]
        if any(counts):
            ax.bar(starts, counts, width=54, bottom=bottom, align="edge", color=color,
                   label=f"{kind} ({sum(counts)})")
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("requests / minute")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Soak: red = engine killed (band: until back), grey = weaver serve "
                 "restarting", fontsize=10)


def _resources(ax_rss, ax_count, ax_shm, samples: list[dict[str, Any]], verdict: str) -> None:
    times = [s["at_s"] for s in samples]
    ax_rss.plot(times, [s["rss_mib"] for s in samples], ".", markersize=2, color="tab:green")
    ax_rss.set_ylabel("gateway RSS (MiB)")
    ax_rss.set_title(verdict[:180], fontsize=8)
    ax_count.plot(times, [s["fds"] for s in samples], ".", markersize=2, label="gateway fds")
    ax_count.plot(times, [s["threads"] for s in samples], ".", markersize=2,
                  label="gateway threads")
    ax_count.set_ylabel("count")
    ax_count.legend(loc="upper left", fontsize=8)
    ax_shm.plot(times, [s["shm_mib"] for s in samples], ".", markersize=2, color="tab:purple",
                label="/dev/shm the server maps (MiB)")
    ax_sockets = ax_shm.twinx()
    ax_sockets.plot(times, [s["socket_files"] for s in samples], ".", markersize=2,
                    color="tab:brown", label="vLLM socket files (right)")
    ax_shm.set_ylabel("/dev/shm (MiB)")
    ax_sockets.set_ylabel("socket files")
    handles = ax_shm.get_legend_handles_labels()[0] + ax_sockets.get_legend_handles_labels()[0]
    ax_shm.legend(handles=handles, loc="upper left", fontsize=8)


def _pairs(ax, pair_samples: list[dict[str, Any]]) -> None:
    names = sorted({name for s in pair_samples for name in s["statuses"]})
    for row, name in enumerate(names):
        points = [(s["at_s"], s["statuses"].get(name)) for s in pair_samples]
        ok = [t for t, status in points if status == "ok"]
        other = [t for t, status in points if status not in ("ok", None)]
        ax.plot(ok, [row] * len(ok), "|", color="tab:green", markersize=8)
        ax.plot(other, [row] * len(other), "|", color="tab:red", markersize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(-0.5, max(len(names), 1) - 0.5)
    ax.set_ylabel("pair (green ok,\nred not)")


def plot(result: dict[str, Any], out_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2, 2, 1.2]})
    _mark_events(list(axes), result)
    _outcomes(axes[0], result)
    _resources(axes[1], axes[2], axes[3], result["samples"], result["verdict"])
    _pairs(axes[4], result["pair_samples"])
    axes[4].set_xlabel("time since the load started (s)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
