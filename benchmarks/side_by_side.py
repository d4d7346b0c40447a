"""Two models served side by side in one run, one over the other, over runs that swap their
cores: what a difference between two engines' setups costs, free of the machine's drift.

Runs one after another on this project's CPU drift apart by more than a 10 % effect, so a
setup is compared with another while both serve the same load at the same time, one per
core; a second run with the cores swapped (another deployment file) cancels a difference
between the cores. Reads `weaver bench compare` (or `weaver bench`) results whose runs each
served both models, and reports the mean TPOT (per request, then the mean) of `--model` over
`--over` in each run and their geometric mean; the JSON opens with it. The comparison holds
only if both models were sent the same requests (swapping the cores does not cancel a
difference between two streams), so the verdict opens with "not comparable" when they were
not: `weaver bench` draws each model's requests of its own unless one is a copy of the
other's (`--model lending=same:plain`).

    weaver bench compare benchmarks/deployments/two_hots/cold_twins.yaml \\
        benchmarks/deployments/two_hots/cold_twins_swapped.yaml --model plain=0.3 \\
        --model lending=same:plain --trace uniform:16-48:64-160 --max-model-len 512 \\
        --num-requests 90 --duration-s 330 --out twins.json
    python benchmarks/side_by_side.py twins.json --model lending --over plain \\
        --out benchmarks/results/two_hots/cold_twins.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from weaver.results.records import RunResult, load_result


def run_ratio(run: RunResult, model: str, over: str) -> dict:
    """One run: each model's mean and median TPOT (its run summary's), and the ratio of the
    means."""
    row: dict = {"label": run.label}
    for name in (model, over):
        summary = run.summary.get(name)
        tpot = summary.tpot if summary is not None else None
        if tpot is None:
            raise SystemExit(f"run {run.label!r} has no finished {name!r} request with a TPOT; "
                             f"its models: {sorted({r.model for r in run.records})}")
        row[name] = {"mean_tpot_ms": 1000 * tpot.mean, "p50_tpot_ms": 1000 * tpot.p(50),
                     "num_requests": tpot.num}
    row["ratio"] = row[model]["mean_tpot_ms"] / row[over]["mean_tpot_ms"]
    return row


def stream(run: RunResult, model: str) -> list[tuple[float, int, int]]:
    """What the model was sent in the run: (arrival, prompt, output tokens), by arrival."""
    return sorted((round(r.scheduled_at_s, 3), r.input_tokens, r.output_tokens)
                  for r in run.records if r.model == model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="bench JSON whose runs served both models")
    parser.add_argument("--model", required=True, help="the model whose setup is measured")
    parser.add_argument("--over", required=True, help="the model it is compared with")
    parser.add_argument("--out", type=Path, required=True, help="the report's JSON path")
    args = parser.parse_args(argv)
    runs = [run for path in args.results for run in load_result(path).runs]
    rows = [run_ratio(run, args.model, args.over) for run in runs]
    ratios = [row["ratio"] for row in rows]
    geomean = math.exp(statistics.mean(math.log(r) for r in ratios))
    verdict = (f"{args.model} over {args.over}, mean TPOT side by side: x{geomean:.3f} "
               f"(geometric mean of {len(rows)} runs: "
               + ", ".join(f"{row['label']} x{row['ratio']:.3f}" for row in rows) + ")")
    # Swapping the cores cancels a difference between them, not one between the requests:
    # near capacity a burstier stream alone moves the mean TPOT by more than a setup does.
    apart = [run.label for run in runs if stream(run, args.model) != stream(run, args.over)]
    if apart:
        verdict = (f"not comparable: the two models were sent different requests (arrival "
                   f"times or lengths) in {', '.join(apart)}, so the ratio mixes their setups "
                   f"with their streams; {verdict}")
    report = {"verdict": verdict, "ratio": geomean, "same_requests": not apart, "runs": rows,
              "command": sys.argv}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    for row in rows:
        print(f"{row['label']}: {args.model} {row[args.model]['mean_tpot_ms']:.1f} ms, "
              f"{args.over} {row[args.over]['mean_tpot_ms']:.1f} ms, x{row['ratio']:.3f}")
    print(verdict)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
