"""Planner + simulator at cluster scale: 32 models on 64 A100s (weaver/sim/configs/
scale_64gpu.yaml, power-law popularity). Plans the cluster, simulates the candidates and
the dedicated placement, writes OUT/scale_64gpu/plan.json (+ plan.png from that file) and
prints the simulated goodput of the planner's choice against dedicated, with wall times.

With --nodes N --cluster DIR it also plans the cluster as GPU deployments must run it (a
GPU per model: `weaver serve` runs mux groups on CPU engines only) and writes that plan as
a cluster file for Ray (DIR/cluster.yaml + DIR/node<i>.yaml, as `weaver plan --nodes
--cluster` does). With --total-rates it repeats both plans at each total request rate
(the models' rates scaled together) and writes OUT/<config>/scale.json + scale.png: the
goodput of dedicated, MuxServe (the planner's best placement without weaving, GPUs packed),
the planner's choice, and Weaver with a GPU per model (its best woven placement).

    python benchmarks/sim_scale.py [--config scale_64gpu] [--out results/sim]
    python benchmarks/sim_scale.py --nodes 16 --cluster benchmarks/cluster/scale_64gpu \\
        --total-rates 250 500 750 --out benchmarks/results/sim_scale
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from weaver.cli.simulate import resolve_config
from weaver.cluster.from_plan import write_cluster
from weaver.sim import plots
from weaver.sim.config import SimConfig
from weaver.sim.plan import Plan
from weaver.sim.plan_deployment import best_candidate, best_plain
from weaver.sim.planner import plan_cluster


def with_total_rate(config: SimConfig, total_rate: float) -> SimConfig:
    """The config with every model's rate scaled so that they sum to total_rate."""
    now = sum(m.rate for m in config.models)
    models = [m.model_copy(update={"rate": m.rate * total_rate / now}) for m in config.models]
    return config.model_copy(update={"models": models})


def goodputs(packed: dict, exclusive: dict) -> dict[str, dict]:
    """Goodput, token throughput and SLO attainment of the four placements compared."""

    def totals(entry: dict) -> dict:
        total = entry["summary"]["_all"]
        return {"label": entry["label"], "goodput_rps": total["goodput_rps"],
                "output_tokens_per_s": total["output_tokens_per_s"],
                "slo_attainment": total["slo_attainment"]}  # fmt: skip

    return {
        "dedicated": totals(packed["baseline"]),
        "muxserve": totals(best_plain(packed)),
        "planner_choice": totals(packed["chosen"]),
        "weaver_gpu_per_model": totals(best_candidate(exclusive)),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="scale_64gpu",
                        help="packaged config name or YAML path (default: %(default)s)")
    parser.add_argument("--out", default="results/sim", help="output folder")
    parser.add_argument("--nodes", type=int, help="nodes of the cluster file (with --cluster)")
    parser.add_argument("--cluster", type=Path,
                        help="write the GPU-per-model plan's cluster file and node "
                             "deployments here (with --nodes)")  # fmt: skip
    parser.add_argument("--total-rates", type=float, nargs="+",
                        help="total request rates to compare the placements at (default: "
                             "the config's)")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.nodes is None) != (args.cluster is None):
        parser.error("--nodes and --cluster go together: --nodes N --cluster DIR")
    config = resolve_config(args.config)
    own_rate = sum(m.rate for m in config.models)
    if args.cluster is not None and not any(
        math.isclose(r, own_rate, rel_tol=1e-9) for r in args.total_rates or [own_rate]
    ):
        parser.error(f"--cluster writes the plan at the config's own rate, {own_rate:g} "
                     "req/s: include it in --total-rates")
    start = time.perf_counter()
    result = plan_cluster(config, progress=True)
    wall = time.perf_counter() - start
    result["benchmark"] = {"wall_s": wall, "num_gpus": config.cluster.num_gpus,
                           "num_models": len(config.models)}
    path = Path(args.out) / config.name / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    plots.plot_plan(path, path.with_suffix(".png"))
    for entry in result["candidates"] + [result["baseline"]]:
        total, sim = entry["summary"]["_all"], entry["sim"]
        print(f"{entry['label']:<55} {total['output_tokens_per_s']:8.0f} tok/s  "
              f"goodput {total['goodput_rps']:7.2f} req/s  SLO attainment "
              f"{total['slo_attainment']:.1%}  ({sim['num_events']} events, "
              f"{sim['wall_s']:.1f} s wall)")
    print(f"chosen {result['chosen']['label']}: goodput x{result['goodput_gain']:.2f}, "
          f"token throughput x{result['token_throughput_gain']:.2f} vs "
          f"{result['baseline']['label']}; planning took {wall:.1f} s")
    print(f"results: {path}")
    if args.cluster is None and not args.total_rates:
        return 0

    points = []
    for total_rate in args.total_rates or [own_rate]:
        is_own = math.isclose(total_rate, own_rate, rel_tol=1e-9)  # the rates sum to it
        scaled = config if is_own else with_total_rate(config, total_rate)
        packed = result if is_own else plan_cluster(scaled, progress=True)
        exclusive = plan_cluster(scaled, progress=True, exclusive_devices=True)
        point = {"total_rate": total_rate, "placements": goodputs(packed, exclusive)}
        points.append(point)
        print(f"total rate {total_rate:g} req/s: " + ", ".join(
            f"{name} {p['goodput_rps']:.1f} req/s ({p['slo_attainment']:.0%} in SLO)"
            for name, p in point["placements"].items()))  # fmt: skip
        if args.cluster is not None and is_own:
            entry = best_candidate(exclusive)
            cluster_file = write_cluster(config, Plan.from_dict(entry["plan"]), args.nodes,
                                         args.cluster)  # fmt: skip
            point["cluster_file"] = str(cluster_file)
            print(f"cluster file ({entry['label']}, {args.nodes} nodes): {cluster_file}")
    scale = {"config": config.name, "num_gpus": config.cluster.num_gpus,
             "num_models": len(config.models), "config_total_rate": own_rate,
             "points": points}  # fmt: skip
    scale_path = path.with_name("scale.json")
    scale_path.write_text(json.dumps(scale, indent=1))
    print(f"placements compared: {scale_path}, plot: "
          f"{plots.plot_scale(scale_path, scale_path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
