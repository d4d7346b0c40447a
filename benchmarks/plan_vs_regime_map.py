"""Does the planner's answer ("weaving pays here" / "does not pay") agree with the regime
map (benchmarks/regime_map.py) for the map's cells?

For each cell and SLO of a regime map's JSON, `weaver plan` is asked about the cell's
deployment (its hot and cold model, two GPUs, its workload, the SLO's targets) at the
highest hot rate that the better of dedicated and Weaver sustains there (the map's
goodput). The map says weaving pays when Weaver's goodput is above dedicated's. Where
weaving pays, Weaver meets the SLO at that rate and dedicated does not; where it does not,
both do, and the planner should not weave.

The two answer different questions, which this prints beside each disagreement: the map
judges the hot model's goodput with `auto` against dedicated, over 3 seeds and a grid of
rates; the planner judges every model's requests (the cold one's too) at one rate and
seed, tries two fixed offload ratios beside `auto` and packed placements beside
dedicated, and refuses a woven placement that raises a cold model's TPOT over its budget.

    python benchmarks/plan_vs_regime_map.py benchmarks/results/sim_regime_map/regime_map.json
    python benchmarks/plan_vs_regime_map.py MAP.json --models llama-2-13b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.regime_map import WORKLOADS, cell_config  # noqa: E402
from weaver.sim.config import SimConfig  # noqa: E402
from weaver.sim.plan_deployment import best_plain, best_woven, weaving_answer  # noqa: E402
from weaver.sim.planner import plan_cluster  # noqa: E402


def planner_config(cell: dict, slo: str) -> SimConfig:
    """The cell's deployment for the planner: the map's cell at the question's rate, its
    placement left to the planner, the SLO's targets."""
    goodput = cell["goodput_rps"][slo]
    rate = max(goodput["dedicated"], goodput["weaver"])
    config = cell_config(cell["model"], cell["device"], WORKLOADS[cell["workload"]], 40.0)
    return config.with_rate("hot", rate).model_copy(update={
        "placement": None, "slo": config.slo.model_copy(update=cell["slos"][slo])})


def ask(cell: dict, slo: str) -> dict:
    config = planner_config(cell, slo)
    result = plan_cluster(config, exclusive_devices=True)
    answer = weaving_answer(result, config.weaving)
    goodput = cell["goodput_rps"][slo]
    return {"model": cell["model"], "device": cell["device"], "workload": cell["workload"],
            "slo": slo, "rate": config.model("hot").rate,
            "map_pays": goodput["weaver"] > goodput["dedicated"],
            "plan_pays": answer.startswith("weaving pays here"), "answer": answer,
            **why(result)}


def why(result: dict) -> dict:
    """What the planner's answer rests on: each model's goodput woven over plain (the map
    judges the hot model's alone), and whether its pair lends the cold model's KV to the
    hot one (it pairs by rate: the map's cold model at 1 req/s may be the busier one)."""
    woven, plain = best_woven(result), best_plain(result)
    if woven is None:
        return {"woven_over_plain": None, "pair": None}
    ratio = {name: _ratio(woven["summary"][name]["goodput_rps"],
                          plain["summary"][name]["goodput_rps"]) for name in ("hot", "cold")}
    hot_gpu = woven["plan"]["pairs"][0]["hot_gpu"]
    pair = "hot->cold" if "hot" in woven["plan"]["gpus"][hot_gpu]["models"] else "cold->hot"
    return {"woven_over_plain": ratio, "pair": pair}


def _ratio(value: float, base: float) -> float | None:
    return None if base <= 0 else round(value / base, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("map", type=Path, help="a regime map's regime_map.json")
    parser.add_argument("--models", nargs="+", help="only these models' cells")
    parser.add_argument("--out", type=Path, help="write the answers here as JSON")
    args = parser.parse_args(argv)
    logging.disable(logging.INFO)  # the planner logs every simulation
    cells = [c for c in json.loads(args.map.read_text())["cells"]
             if "goodput_rps" in c and (not args.models or c["model"] in args.models)]
    rows = [ask(cell, slo) for cell in cells for slo in cell["goodput_rps"]]
    for row in rows:
        agrees = "agrees   " if row["map_pays"] == row["plan_pays"] else "DISAGREES"
        print(f"{agrees} {row['model']:<12} {row['device']:<10} {row['workload']:<12} "
              f"{row['slo']:<6} {row['rate']:>6g} req/s map {'pays' if row['map_pays'] else '-':4}"
              f" | woven/plain {row['woven_over_plain']} {row['pair']} | {row['answer']}")
    agree = sum(r["map_pays"] == r["plan_pays"] for r in rows)
    pays = [r for r in rows if r["map_pays"]]
    verdict = (f"planner agrees with the map in {agree} of {len(rows)} cell-SLOs; where the "
               f"map says weaving pays: {sum(r['plan_pays'] for r in pays)} of {len(pays)}; "
               f"where it does not: "
               f"{sum(not r['plan_pays'] for r in rows if not r['map_pays'])} of "
               f"{len(rows) - len(pays)}")
    print(verdict)
    if args.out:
        args.out.write_text(json.dumps({"verdict": verdict, "map": str(args.map),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
