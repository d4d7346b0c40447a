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

`--fan-in` adds a column: the hot GPU weaving (`auto`, the same targets) into two cold
GPUs, each serving a cold model of the same shape at the same 1 req/s, as
weaver/sim/configs/kv_bound_a100_two_colds.yaml does, so each cold GPU is loaded as the
one-to-one cell's is and a second cold only adds lent KV and idle compute. Its gain over
one cold is per cell and SLO; `--fan-in near-pay` runs it only where one cold already
raised goodput over dedicated (is_near_pay), for when the whole map is too long.

    python benchmarks/regime_map.py --out benchmarks/results/sim_regime_map
    python benchmarks/regime_map.py --models llama-3-8b --devices H100-80GB --workloads conv
    python benchmarks/regime_map.py --models llama-2-13b --fan-in all --jobs 1

Writes OUT/regime_map.json (it opens with its verdict) and OUT/regime_map.png (one heat
map per SLO: weaving's goodput over dedicated's and over MuxServe's, per cell); with
`--fan-in`, OUT/regime_map_fan_in.png (two colds' goodput over one cold's, per cell).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
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
# --fan-in: the column of the hot GPU weaving (`auto`) into two cold GPUs.
FAN_IN = "weaver_two_colds"
NUM_FAN_IN_COLDS = 2
# Where --fan-in runs the two-colds column: every cell, or (cheaper) the cells where one
# cold already raised goodput (is_near_pay).
FAN_IN_WHERE = ("all", "near-pay")
PAYS_GAIN = 0.10  # weaving "pays" in a cell at this gain over dedicated
NEAR_PAY_MARGIN = 0.10  # --fan-in near-pay: "within 10 % of paying"
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
                hot_tpot_ms: float | None = None, num_colds: int = 1) -> SimConfig:
    """`hot_tpot_ms`: the target `auto` holds the hot model's woven steps to. `num_colds`:
    the cold GPUs the hot one weaves into, each serving its own cold model at `COLD_RATE`
    (weaver/sim/configs/kv_bound_a100_two_colds.yaml: the one-cold cell's cold GPU twice)."""
    colds = ["cold", *(f"cold{i + 1}" for i in range(1, num_colds))]  # cold: one-to-one's
    suffix = "" if num_colds == 1 else f"_{num_colds}colds"
    return SimConfig.model_validate({
        "name": f"regime_{shape}_{device}_{trace.split(':')[0]}{suffix}",
        "duration_s": duration_s,
        "workload": {"trace": trace},
        "cluster": {"device": device, "num_gpus": 1 + num_colds},
        "models": [{"name": "hot", "shape": shape, "rate": 1.0},
                   *({"name": c, "shape": shape, "rate": COLD_RATE} for c in colds)],
        # One policy over every cold: the pairs of a hot GPU share its ratio and targets.
        "placement": {"gpus": [{"models": ["hot"]}, *({"models": [c]} for c in colds)],
                      "pairs": [{"hot_gpu": 0, "cold_gpu": 1 + i, "offload_ratio": "auto",
                                 "hot_tpot_ms": hot_tpot_ms} for i in range(num_colds)]},
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
            "num_submitted": num_hot, "lent_kv": result.get("lent_kv", {}).get("hot", [])}


def weaving_use(runs: list[dict]) -> dict[str, float]:
    """Seeds' means of what weaving used: the share of the hot model's finished requests
    whose KV sat on a cold GPU, and the lent KV's peak (each cold's most blocks held at
    once, summed, over the blocks lent: 1.0 where every cold's lent KV filled)."""
    shares, peaks = [], []
    for records in runs:
        done = [r for r in records["records"] if r["e2e_s"] is not None]
        shares.append(sum(r["is_remote"] for r in done) / len(done) if done else 0.0)
        pools = records["lent_kv"]
        lent = sum(p["capacity_blocks"] for p in pools)
        peaks.append(sum(p["peak_blocks"] for p in pools) / lent if lent else 0.0)
    return {"remote_share": round(sum(shares) / len(shares), 3),
            "lent_kv_peak": round(sum(peaks) / len(peaks), 3)}


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
             duration_s: float, fan_in: str | None = None) -> dict:
    """One cell's goodputs and gains; `fan_in` ("all", "near-pay" or None): where to add
    the two-colds column (FAN_IN_WHERE)."""
    trace = WORKLOADS[workload]
    config = cell_config(shape, device, trace, duration_s)
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
    grid = Grid(rates, seeds, slos, duration_s)
    goodput, use = grid.run(_jobs((shape, device, trace, duration_s), slos))
    gain = {name: {rival: _gain(g["weaver"], g[rival]) for rival in ("dedicated", "muxserve")}
            for name, g in goodput.items()}
    # Per Weaver column and rate of the grid: weaving_use's remote share and lent KV peak.
    cell.update(rates=rates, goodput_rps=goodput, gain=gain, weaving_use=use)
    if fan_in == "all" or (fan_in == "near-pay" and is_near_pay(gain)):
        more, more_use = grid.run(_jobs((shape, device, trace, duration_s), slos,
                                        NUM_FAN_IN_COLDS))
        for name in slos:
            goodput[name].update(more[name])
            use[name].update(more_use[name])
        cell["fan_in_gain"] = {name: {"over_one_cold": _gain(g[FAN_IN], g["weaver"]),
                                      "over_dedicated": _gain(g[FAN_IN], g["dedicated"])}
                               for name, g in goodput.items()}
    elif fan_in:
        cell["fan_in_gain"] = None  # near-pay: one cold ties dedicated here, not run
    cell["at_grid_top"] = {name: [p for p, v in g.items() if v == rates[-1]]
                           for name, g in goodput.items()}
    return cell


def is_near_pay(gain: dict[str, dict[str, float | None]]) -> bool:
    """One-to-one weaving pays (>= +10 % over dedicated) or comes within 10 % of paying
    under some SLO. On the rate grid the smallest gain above a tie is +20 % (6 over 5), so
    this is "one cold raised goodput at all": in a tie one cold's lent KV bought nothing."""
    return any((g["dedicated"] or 0.0) > PAYS_GAIN - NEAR_PAY_MARGIN for g in gain.values())


@dataclass(frozen=True)
class Grid:
    """A cell's rates, seeds and SLOs: what each column's runs are judged over."""

    rates: list[float]
    seeds: list[int]
    slos: dict[str, Slo]
    duration_s: float

    def run(self, jobs: list[tuple[str, str, SimConfig, list[str]]]) -> tuple[dict, dict]:
        """Each job's goodput per SLO it is judged under ({slo: {column: rps}}), and, for
        Weaver's columns, weaving_use per rate ({slo: {column: {rate: use}}}). A job stops
        at the first rate every one of its SLOs fails (seeds pooled): goodput counts no
        rate above it."""
        goodput: dict[str, dict[str, float]] = {name: {} for name in self.slos}
        use: dict[str, dict[str, dict[str, dict]]] = {name: {} for name in self.slos}
        for column, policy, config, judged in jobs:
            points: dict[str, list[tuple[float, float]]] = {name: [] for name in judged}
            for rate in self.rates:
                runs = [run(config, policy, rate, seed) for seed in self.seeds]
                for name in judged:
                    points[name] += [(rate, attainment(r, self.slos[name], self.duration_s))
                                     for r in runs]
                    if policy == "weaver":
                        use[name].setdefault(column, {})[str(rate)] = weaving_use(runs)
                if all(goodput_rate(points[name]) < rate for name in judged):
                    break
            for name in judged:
                goodput[name][column] = goodput_rate(points[name])
        return goodput, use


def _jobs(cell: tuple[str, str, str, float], slos: dict[str, Slo],
          num_colds: int = 1) -> list[tuple[str, str, SimConfig, list[str]]]:
    """(column, simulated policy, config, SLOs judged) of a cell: with one cold, dedicated
    and MuxServe (run once, judged under each SLO) and Weaver; with more, Weaver alone.
    Weaver runs once per SLO, its `auto` held to that SLO's TPOT as a deployment for it
    would be. `cell`: cell_config's shape, device, trace and duration."""
    jobs = [(p, p, cell_config(*cell), list(slos)) for p in POLICIES
            if p != "weaver" and num_colds == 1]
    column = "weaver" if num_colds == 1 else FAN_IN
    for name, slo in slos.items():
        target_ms = SLO_TPOT_SHARE * slo.tpot_s * 1e3
        jobs.append((column, "weaver", cell_config(*cell, target_ms, num_colds), [name]))
    return jobs


def _gain(weaver: float, rival: float) -> float | None:
    return None if rival <= 0 else weaver / rival - 1


def plot(result: dict, png: Path) -> Path:
    """One heat map per SLO and rival: weaving's goodput over dedicated's and MuxServe's."""
    panels = [(f"Weaver over {rival}, {slo} SLO (% goodput)",
               lambda c, slo=slo, rival=rival: c["gain"][slo][rival])
              for slo in SLOS for rival in ("dedicated", "muxserve")]
    return _heat_maps(result["cells"], panels, png)


def plot_fan_in(result: dict, png: Path) -> Path:
    """One heat map per SLO: two colds' goodput over one cold's (--fan-in)."""
    panels = [(f"two colds over one, {slo} SLO (% goodput)",
               lambda c, slo=slo: (c.get("fan_in_gain") or {}).get(slo, {}).get("over_one_cold"))
              for slo in SLOS]
    return _heat_maps(result["cells"], panels, png)


def _heat_maps(cells: list[dict], panels: list[tuple[str, Callable[[dict], float | None]]],
               png: Path) -> Path:
    """A (model, workload) x GPU heat map of a gain per panel; "-" where there is none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({(c["model"], c["workload"]) for c in cells})
    cols = list(dict.fromkeys(c["device"] for c in cells))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 0.45 * len(rows) + 2),
                             squeeze=False)
    for k, (ax, (title, gain_of)) in enumerate(zip(axes[0], panels, strict=True)):
        grid = [[float("nan")] * len(cols) for _ in rows]
        for c in cells:
            gain = gain_of(c) if "gain" in c else None
            if gain is not None:
                grid[rows.index((c["model"], c["workload"]))][cols.index(c["device"])] = 100 * gain
        image = ax.imshow(grid, cmap="RdYlGn", vmin=-50, vmax=50, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, "-" if value != value else f"{value:+.0f}", ha="center",
                        va="center", fontsize=7)
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=20)
        # The rows' names once, left of the first panel (they overlapped the next ones).
        ax.set_yticks(range(len(rows)), [f"{m}, {w}" for m, w in rows] if k == 0 else [],
                      fontsize=7)
        ax.set_title(title, fontsize=8)
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


def verdict_fan_in(cells: list[dict]) -> str:
    """Two colds against one (--fan-in), over every cell and SLO with both goodputs."""
    gains = [(c["fan_in_gain"][slo]["over_one_cold"], c, slo) for c in cells
             if c.get("fan_in_gain") for slo in SLOS
             if c["fan_in_gain"][slo]["over_one_cold"] is not None]
    num_skipped = sum("fan_in_gain" in c and c["fan_in_gain"] is None for c in cells)
    pays = [slo for g, _, slo in gains if g >= PAYS_GAIN]
    best = max(gains, key=lambda gcs: gcs[0], default=None)
    return (f"two colds over one: >= +10 % in {len(pays)} of {len(gains)} cell-SLOs ("
            + ", ".join(f"{slo} {pays.count(slo)}" for slo in SLOS) + ")"
            + f", <= -10 % in {sum(g <= -0.10 for g, _, _ in gains)}"
            + ("" if best is None else
               f"; best {best[0]:+.0%} ({best[1]['model']}, {best[1]['device']}, "
               f"{best[1]['workload']}, {best[2]} SLO)")
            + (f"; not run in {num_skipped} cells where one cold ties dedicated (near-pay)"
               if num_skipped else ""))


def replot(path: Path) -> int:
    result = json.loads(path.read_text())
    print(plot(result, path.with_suffix(".png")))
    if any("fan_in_gain" in c for c in result["cells"]):
        print(plot_fan_in(result, path.parent / "regime_map_fan_in.png"))
    return 0


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
    parser.add_argument("--fan-in", choices=FAN_IN_WHERE,
                        help=f"also weave the hot model into {NUM_FAN_IN_COLDS} cold GPUs "
                        f"(column {FAN_IN}, OUT/regime_map_fan_in.png): in all cells, or "
                        "near-pay: where one cold raised goodput over dedicated at all")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_regime_map"))
    parser.add_argument("--replot", type=Path, metavar="MAP_JSON",
                        help="draw a saved map's plots into its folder; simulate nothing")
    args = parser.parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    seeds = list(range(args.seeds))
    grid = [(m, d, w) for m in args.models for d in args.devices for w in args.workloads]
    # Cells are independent: --jobs processes take them in turn (a cell is 10-100 s).
    with ProcessPoolExecutor(args.jobs) as pool, \
            tqdm(total=len(grid), desc="regime map", unit="cell") as bar:
        futures = [pool.submit(map_cell, *cell, seeds, args.duration_s, args.fan_in)
                   for cell in grid]
        for future in as_completed(futures):
            cell = future.result()
            bar.set_postfix_str(f"{cell['model']} {cell['device']} {cell['workload']}")
            bar.update()
        cells = [f.result() for f in futures]
    command = "python benchmarks/regime_map.py " + " ".join(argv if argv else sys.argv[1:])
    summary = verdict(cells) + (f"; {verdict_fan_in(cells)}" if args.fan_in else "")
    result = {"verdict": summary, "command": command.strip(), "seeds": seeds,
              "slos": {k: vars(v) for k, v in SLOS.items()}, "rate_grid": list(RATE_GRID),
              "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "regime_map.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['verdict']}\n{path}\n{plot(result, path.with_suffix('.png'))}")
    if args.fan_in:
        print(plot_fan_in(result, args.out / "regime_map_fan_in.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
