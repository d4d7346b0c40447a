"""Does the planner's answer agree with the regime map (benchmarks/regime_map.py) for the
map's cells? Two questions: does weaving pay (against dedicated), and, in the cells where
the map has its two-colds column (`--fan-in`), should the hot model weave into two colds
rather than one.

Weaving: for each cell and SLO of a regime map's JSON, `weaver plan` is asked about the
cell's deployment (its hot and cold model, two GPUs, its workload, the SLO's targets) at
the highest hot rate that the better of dedicated and Weaver sustains there (the map's
goodput). The map says weaving pays when Weaver's goodput is above dedicated's. Where
weaving pays, Weaver meets the SLO at that rate and dedicated does not; where it does not,
both do, and the planner should not weave.

The two answer different questions, which this prints beside each disagreement: the map
judges the hot model's goodput with `auto` against dedicated, over 3 seeds and a grid of
rates; the planner judges every model's requests (the cold one's too) at one rate and
seed, tries two fixed offload ratios beside `auto` and packed placements beside
dedicated, and refuses a woven placement that raises a cold model's TPOT over its budget.

One hot over two colds: the planner is asked about the map's two-colds deployment (the
hot model and two cold ones of its shape at 1 req/s each, three GPUs) at the highest hot
rate that the better of one cold and two colds sustains. The map says two colds pay when
their goodput is >= 10 % above one cold's (as its verdict counts them); the planner says
so when the placement it chooses is its fan-in (FAN_IN_CHOICE: `auto`, the busiest GPU
woven into every GPU under half its load). It chooses one where it is clearly better (its
noise rule) than what it would serve otherwise, plain or one cold, and keeps each cold
within its TPOT budget; and it tries one only where both colds carry under half the hot
model's load, so at a hot rate of 2 req/s or less (the colds' 1 req/s each) it is not
asked: those cell-SLOs are counted apart.

    python benchmarks/plan_vs_regime_map.py benchmarks/results/sim_regime_map/regime_map.json \
        --out benchmarks/results/sim_regime_map/plan_vs_map.json
    python benchmarks/plan_vs_regime_map.py MAP.json --models llama-2-13b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.regime_map import (  # noqa: E402
    COLD_RATE,
    FAN_IN,
    NUM_FAN_IN_COLDS,
    PAYS_GAIN,
    WORKLOADS,
    cell_config,
)
from weaver.sim.config import SimConfig  # noqa: E402
from weaver.sim.plan_deployment import best_plain, best_woven, weaving_answer  # noqa: E402
from weaver.sim.planner import plan_cluster  # noqa: E402
from weaver.weaving.placement import AUTO  # noqa: E402


def planner_config(cell: dict, slo: str, num_colds: int = 1) -> SimConfig:
    """The cell's deployment for the planner: the map's cell (with `num_colds` cold GPUs,
    as its columns have) at the question's rate, its placement left to the planner, the
    SLO's targets. The rate: the highest the better of the two columns compared sustains
    (dedicated and Weaver; with two colds, Weaver over one cold and over two)."""
    goodput = cell["goodput_rps"][slo]
    compared = ("dedicated", "weaver") if num_colds == 1 else ("weaver", FAN_IN)
    rate = max(goodput[column] for column in compared)
    config = cell_config(cell["model"], cell["device"], WORKLOADS[cell["workload"]], 40.0,
                         num_colds=num_colds)
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


def has_fan_in_column(cell: dict, slo: str) -> bool:
    """The map ran two colds here and can compare them with one (one cold sustained some
    rate: the map's verdict leaves a gain over nothing out too)."""
    gain = (cell.get("fan_in_gain") or {}).get(slo)
    return gain is not None and gain["over_one_cold"] is not None


def ask_fan_in(cell: dict, slo: str) -> dict:
    config = planner_config(cell, slo, NUM_FAN_IN_COLDS)
    return fan_in_row(cell, slo, config.model("hot").rate,
                      plan_cluster(config, exclusive_devices=True))


def fan_in_row(cell: dict, slo: str, rate: float, result: dict) -> dict:
    """The map's and the planner's answer to "one hot over two colds rather than one",
    and what the planner's rests on. `plan_pays` is None where it tried no fan-in."""
    fan_in = next((c for c in result["candidates"] if is_fan_in(c)), None)
    row = {"model": cell["model"], "device": cell["device"], "workload": cell["workload"],
           "slo": slo, "rate": rate,
           "map_pays": cell["fan_in_gain"][slo]["over_one_cold"] >= PAYS_GAIN,
           "plan_pays": None if fan_in is None else is_fan_in(result["chosen"]),
           "chosen": result["chosen"]["label"]}
    if fan_in is None:
        return {**row, "not_asked": (
            f"no fan-in tried: the colds' {COLD_RATE:g} req/s each is not under half the "
            f"hot model's {rate:g} req/s (fan_in_pairs weaves only into such GPUs)")}
    # One cold's `auto` as the map's one-cold column: where it lends too much of its one
    # cold's KV (over that cold's TPOT budget) the planner may take the fan-in at a tie.
    one_cold = next((c for c in result["candidates"] if _is_one_cold_auto(c)), None)
    factors = {name: round(f, 3) for name, f in fan_in["cold_tpot_factors"].items()}
    return {**row, "two_over_one": None if one_cold is None else over_one_cold(fan_in, one_cold),
            "within_cold_budget": fan_in["within_cold_budget"], "cold_tpot_factors": factors,
            "one_cold_within_budget": None if one_cold is None else one_cold["within_cold_budget"]}


def over_one_cold(fan_in: dict, one_cold: dict) -> dict[str, float | None]:
    """The fan-in's goodput over the one-cold `auto` candidate's, the hot model's (what the
    map judges) and every model's, and its token throughput over the one cold's (the
    planner's tie-break: is_clearly_better takes a goodput within 1 % and tokens +1 %)."""
    ratio = {name: _ratio(fan_in["summary"][name]["goodput_rps"],
                          one_cold["summary"][name]["goodput_rps"]) for name in ("hot", "_all")}
    tokens = [c["summary"]["_all"]["output_tokens_per_s"] for c in (fan_in, one_cold)]
    return {**ratio, "tokens": _ratio(*tokens)}


def is_fan_in(entry: dict) -> bool:
    """A planner entry whose one hot GPU weaves into several cold ones."""
    pairs = entry["plan"]["pairs"]
    return len(pairs) >= 2 and len({p["hot_gpu"] for p in pairs}) == 1


def _is_one_cold_auto(entry: dict) -> bool:
    """The woven candidate the map's one-cold column is: one pair, `auto`."""
    pairs = entry["plan"]["pairs"]
    return len(pairs) == 1 and pairs[0]["offload_ratio"] == AUTO


def _ratio(value: float, base: float) -> float | None:
    return None if base <= 0 else round(value / base, 3)


def print_weaving(rows: list[dict]) -> str:
    """Each cell-SLO's two answers to "does weaving pay"; returns the verdict."""
    for row in rows:
        print(f"{_agreement(row)} {_cell_text(row)} map {'pays' if row['map_pays'] else '-':4}"
              f" | woven/plain {row['woven_over_plain']} {row['pair']} | {row['answer']}")
    return agreement_text("planner agrees with the map", "weaving pays", rows)


def print_fan_in(rows: list[dict]) -> str:
    """Each cell-SLO's two answers to "one hot over two colds"; returns the verdict."""
    for row in rows:
        judged = (row["not_asked"] if row["plan_pays"] is None else
                  f"two/one cold {row['two_over_one']} cold TPOT {row['cold_tpot_factors']}"
                  f"{'' if row['within_cold_budget'] else ' over budget'}"
                  f"{'' if row['one_cold_within_budget'] else '; one cold over budget'}")
        print(f"{_agreement(row)} {_cell_text(row)} map "
              f"{'pays' if row['map_pays'] else '-':4} | {judged} | chosen {row['chosen']}")
    return fan_in_verdict(rows)


def fan_in_verdict(rows: list[dict]) -> str:
    asked = [r for r in rows if r["plan_pays"] is not None]
    not_asked = [r for r in rows if r["plan_pays"] is None]
    return (agreement_text("where it tried a fan-in, the planner agrees with the map on "
                           "two colds (>= +10 % goodput over one)", "they pay", asked)
            + f"; not asked in {len(not_asked)} (the hot model at <= {2 * COLD_RATE:g} "
            "req/s: no cold under half its load), where "
            f"the map says they pay in {sum(r['map_pays'] for r in not_asked)}")


def agreement_text(what: str, pays: str, rows: list[dict]) -> str:
    """The verdict line: "WHAT in N of M cell-SLOs; where the map says PAYS: ...; ..."."""
    agree = sum(r["map_pays"] == r["plan_pays"] for r in rows)
    yes = [r for r in rows if r["map_pays"]]
    no = [r for r in rows if not r["map_pays"]]
    return (f"{what} in {agree} of {len(rows)} cell-SLOs; where the map says {pays}: "
            f"{sum(r['plan_pays'] for r in yes)} of {len(yes)}; where it does not: "
            f"{sum(not r['plan_pays'] for r in no)} of {len(no)}")


def _agreement(row: dict) -> str:
    if row["plan_pays"] is None:
        return "not asked"
    return "agrees   " if row["map_pays"] == row["plan_pays"] else "DISAGREES"


def _cell_text(row: dict) -> str:
    return (f"{row['model']:<12} {row['device']:<10} {row['workload']:<12} {row['slo']:<6} "
            f"{row['rate']:>6g} req/s")


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
    verdict = print_weaving(rows)
    print(verdict)
    fan_in_rows = [ask_fan_in(cell, slo) for cell in cells for slo in cell["goodput_rps"]
                   if has_fan_in_column(cell, slo)]
    fan_in = {"verdict": print_fan_in(fan_in_rows), "rows": fan_in_rows} if fan_in_rows else None
    if fan_in:
        print(fan_in["verdict"])
    if args.out:
        summary = verdict + (f"; one hot over two colds: {fan_in['verdict']}" if fan_in else "")
        args.out.write_text(json.dumps({"verdict": summary, "map": str(args.map),
                                        "rows": rows, "fan_in": fan_in}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
