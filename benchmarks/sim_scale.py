"""Planner + simulator at cluster scale: 32 models on 64 A100s (weaver/sim/configs/
scale_64gpu.yaml, power-law popularity). Plans the cluster, simulates the candidates and
the dedicated placement, writes OUT/scale_64gpu/plan.json (+ plan.png from that file) and
prints the simulated goodput of the planner's choice against dedicated, with wall times.

    python benchmarks/sim_scale.py [--config scale_64gpu] [--out results/sim]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from weaver.cli.simulate import resolve_config
from weaver.sim import plots
from weaver.sim.planner import plan_cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="scale_64gpu",
                        help="packaged config name or YAML path (default: %(default)s)")
    parser.add_argument("--out", default="results/sim", help="output folder")
    args = parser.parse_args(argv)
    config = resolve_config(args.config)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
