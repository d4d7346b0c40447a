"""Where weaving pays: the simulator's map of Weaver's goodput gain over dedicated serving
and over MuxServe, across models, GPUs, workloads and SLOs.

A cell is one hot model beside a cold one of the same shape (1 req/s) on two GPUs of one
kind, under one workload: dedicated (a GPU each), MuxServe (both on a 2-GPU tensor-
parallel mesh, spatial-temporal) and Weaver (a GPU each, `offload_ratio: auto`: the
engine's adaptive placement, weaver/weaving/placement.py, held to 0.85x the SLO's TPOT and
to 1.10x the cold model's own TPOT) at the same rates of the hot model, `--seeds` seeds
each. The rates are a grid around dedicated's capacity (found
first by doubling the rate), and each SLO judges the same runs. Goodput is the one
definition of weaver/results/goodput.py (>= 90 % of the hot requests within TTFT and
TPOT, at that rate and every lower one, seeds pooled). The TPOT target is a multiple of
the model's TPOT alone on the GPU (MuxServe's SLO scale), the TTFT target absolute.

    python benchmarks/regime_map.py --out benchmarks/results/sim_regime_map
    python benchmarks/regime_map.py --models llama-3-8b --devices H100-80GB --workloads conv

Writes OUT/regime_map.json (it opens with its verdict) and OUT/regime_map.png (one heat
map per SLO: weaving's goodput over dedicated's and over MuxServe's, per cell).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from weaver.results.goodput import Slo, goodput_rate
from weaver.sim.config import SimConfig
from weaver.sim.metrics import summarize
from weaver.sim.perf_model import PerfModel
from weaver.sim.plan import plan_from_spec
from weaver.sim.profile import get_device, get_shape, roofline_profile
from weaver.sim.runner import simulate
from weaver.weaving.placement import SLO_TPOT_SHARE

MODELS = {"llama-3-8b": "Llama-3-8B (GQA)", "llama-2-13b": "Llama-2-13B (MHA)",
          "qwen2.5-3b": "Qwen2.5-3B (small, GQA)"}
DEVICES = ("A100-40GB", "A100-80GB", "L40S", "H100-80GB")
WORKLOADS = {"conv": "azure-conv", "code": "azure-code",
             "long-output": "uniform:512-512:1024-1024"}
POLICIES = ("dedicated", "muxserve", "weaver")
# Multiples of dedicated's largest doubling-search rate that passes (its capacity, to a
# factor of two): the grid every policy of a cell runs.
RATE_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
COLD_RATE = 1.0
CONTEXT_FOR_ISOLATED_TPOT = 1024  # tokens of context behind the isolated TPOT


@dataclass(frozen=True)
class SloScale:
    """A TTFT target in seconds and a TPOT target as a multiple of the TPOT alone."""

    ttft_s: float
    tpot_times_isolated: float


SLOS = {"tight": SloScale(2.0, 3.0), "loose": SloScale(10.0, 6.0)}


def isolated_tpot_s(shape: str, device: str) -> float:
    """One sequence decoding alone on the GPU (the roofline the simulator uses)."""
    perf = PerfModel(roofline_profile(get_shape(shape), get_device(device)))
    return perf.decode_time(1, CONTEXT_FOR_ISOLATED_TPOT)


def cell_config(shape: str, device: str, trace: str, duration_s: float,
                hot_tpot_ms: float | None = None) -> SimConfig:
    """`hot_tpot_ms`: the target `auto` holds the hot model's woven steps to."""
    return SimConfig.model_validate({
        "name": f"regime_{shape}_{device}_{trace.split(':')[0]}",
        "duration_s": duration_s,
        "workload": {"trace": trace},
        "cluster": {"device": device, "num_gpus": 2},
        "models": [{"name": "hot", "shape": shape, "rate": 1.0},
                   {"name": "cold", "shape": shape, "rate": COLD_RATE}],
        "placement": {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}],
                      "pairs": [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": "auto",
                                 "hot_tpot_ms": hot_tpot_ms}]},
        "weaving": {"split": "plan"},
        "server": {"scheduling": "chunked"},
    })


MUXSERVE_PLACEMENT = {"gpus": [{"models": ["hot", "cold"], "tp": 2,
                                "mux": {"mode": "spatial-temporal"}}]}


def run(config: SimConfig, policy: str, rate: float, seed: int) -> dict:
    """The hot model's request records of one run."""
    config = config.with_rate("hot", rate).model_copy(update={"seed": seed})
    plan = None
    if policy == "muxserve":
        from weaver.sim.config import PlacementSpec

        plan = plan_from_spec(PlacementSpec.model_validate(MUXSERVE_PLACEMENT), 0.0)
    result = simulate(config, policy=policy, plan=plan, keep_requests=True)
    num_hot = result["summary"]["hot"]["num_submitted"]
    return {"records": [r for r in result["requests"] if r["model"] == "hot"],
            "num_submitted": num_hot}


def attainment(records: dict, slo: Slo, duration_s: float) -> float:
    summary = summarize(records["records"], slo, {"hot": records["num_submitted"]},
                        window=(0.0, duration_s))
    return summary["hot"]["slo_attainment"] or 0.0


def dedicated_capacity(config: SimConfig, slo: Slo) -> float:
    """Dedicated's largest passing rate of 0.25, 0.5, 1, 2, ... req/s (seed 0)."""
    rate = 0.25
    passing = 0.0
    while rate <= 1024:
        records = run(config, "dedicated", rate, config.seed)
        if attainment(records, slo, config.duration_s) < 0.9:
            break
        passing, rate = rate, rate * 2
    return passing


def map_cell(shape: str, device: str, workload: str, seeds: list[int],
             duration_s: float) -> dict:
    config = cell_config(shape, device, WORKLOADS[workload], duration_s)
    alone_s = isolated_tpot_s(shape, device)
    slos = {name: Slo(ttft_s=s.ttft_s, tpot_s=s.tpot_times_isolated * alone_s)
            for name, s in SLOS.items()}
    base = dedicated_capacity(config, slos["loose"])
    cell = {"model": shape, "device": device, "workload": workload,
            "isolated_tpot_ms": alone_s * 1e3, "dedicated_capacity_rps": base,
            "slos": {k: {"ttft_s": v.ttft_s, "tpot_ms": v.tpot_s * 1e3} for k, v in slos.items()}}
    if base == 0.0:
        cell["note"] = "dedicated misses the loose SLO at 0.25 req/s; no grid"
        return cell
    rates = [round(base * m, 4) for m in RATE_GRID]
    shares: dict[str, dict[str, list[tuple[float, float]]]] = {
        slo: {p: [] for p in POLICIES} for slo in slos}
    # Dedicated and MuxServe run once and are judged under each SLO; Weaver runs once per
    # SLO, its `auto` held to that SLO's TPOT as a deployment for it would be.
    jobs = [(policy, config, list(slos)) for policy in POLICIES if policy != "weaver"]
    jobs += [("weaver", cell_config(shape, device, WORKLOADS[workload], duration_s,
                                    SLO_TPOT_SHARE * slo.tpot_s * 1e3), [name])
             for name, slo in slos.items()]
    for policy, policy_config, judged in jobs:
        for rate in rates:
            for seed in seeds:
                records = run(policy_config, policy, rate, seed)
                for name in judged:
                    shares[name][policy].append(
                        (rate, attainment(records, slos[name], duration_s)))
    cell["rates"] = rates
    cell["goodput_rps"] = {name: {p: goodput_rate(points) for p, points in by_policy.items()}
                           for name, by_policy in shares.items()}
    cell["gain"] = {name: {rival: _gain(g["weaver"], g[rival])
                           for rival in ("dedicated", "muxserve")}
                    for name, g in cell["goodput_rps"].items()}
    cell["at_grid_top"] = {name: [p for p, v in g.items() if v == rates[-1]]
                           for name, g in cell["goodput_rps"].items()}
    return cell


def _gain(weaver: float, rival: float) -> float | None:
    return None if rival <= 0 else weaver / rival - 1


def plot(result: dict, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in result["cells"] if "gain" in c]
    rows = sorted({(c["model"], c["workload"]) for c in result["cells"]})
    cols = list(dict.fromkeys(c["device"] for c in result["cells"]))
    panels = [(slo, rival) for slo in SLOS for rival in ("dedicated", "muxserve")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 0.45 * len(rows) + 2),
                             squeeze=False)
    for ax, (slo, rival) in zip(axes[0], panels, strict=True):
        grid = [[float("nan")] * len(cols) for _ in rows]
        for c in cells:
            gain = c["gain"][slo][rival]
            if gain is not None:
                grid[rows.index((c["model"], c["workload"]))][cols.index(c["device"])] = 100 * gain
        image = ax.imshow(grid, cmap="RdYlGn", vmin=-50, vmax=50, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, "-" if value != value else f"{value:+.0f}", ha="center",
                        va="center", fontsize=7)
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=20)
        ax.set_yticks(range(len(rows)), [f"{m}, {w}" for m, w in rows], fontsize=7)
        ax.set_title(f"Weaver over {rival}, {slo} SLO (% goodput)", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def verdict(cells: list[dict]) -> str:
    judged = [c for c in cells if "gain" in c]
    lines = []
    for slo in SLOS:
        gains = [(c["gain"][slo]["dedicated"], c) for c in judged
                 if c["gain"][slo]["dedicated"] is not None]
        pays = [c for g, c in gains if g >= 0.10]
        hurts = [c for g, c in gains if g <= -0.10]
        best = max(gains, key=lambda gc: gc[0], default=None)
        lines.append(
            f"{slo} SLO: weaving >= +10 % over dedicated in {len(pays)} of {len(gains)} cells"
            + (f" ({', '.join(sorted({c['workload'] for c in pays}))})" if pays else "")
            + f", <= -10 % in {len(hurts)}"
            + ("" if best is None else
               f"; best {best[0]:+.0%} ({best[1]['model']}, {best[1]['device']}, "
               f"{best[1]['workload']})"))
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--devices", nargs="+", default=list(DEVICES), choices=list(DEVICES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per point (default 3)")
    parser.add_argument("--duration-s", type=float, default=40.0,
                        help="seconds of arrivals per run (default 40)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="cells simulated at once (default: the CPU count)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_regime_map"))
    args = parser.parse_args(argv)
    seeds = list(range(args.seeds))
    grid = [(m, d, w) for m in args.models for d in args.devices for w in args.workloads]
    # Cells are independent: --jobs processes take them in turn (a cell is 10-100 s).
    with ProcessPoolExecutor(args.jobs) as pool, \
            tqdm(total=len(grid), desc="regime map", unit="cell") as bar:
        futures = [pool.submit(map_cell, *cell, seeds, args.duration_s) for cell in grid]
        for future in as_completed(futures):
            cell = future.result()
            bar.set_postfix_str(f"{cell['model']} {cell['device']} {cell['workload']}")
            bar.update()
        cells = [f.result() for f in futures]
    command = "python benchmarks/regime_map.py " + " ".join(argv if argv else sys.argv[1:])
    result = {"verdict": verdict(cells), "command": command.strip(), "seeds": seeds,
              "slos": {k: vars(v) for k, v in SLOS.items()}, "rate_grid": list(RATE_GRID),
              "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "regime_map.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['verdict']}\n{path}\n{plot(result, path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
