"""What bounds the hot model near capacity: its batch, its KV and its TPOT, per deployment.

Reads a `weaver bench compare` (or `run`) results file whose runs scraped the gateway's
gauges (`--scrape-metric weaver_num_running --scrape-metric weaver_num_waiting
--scrape-metric weaver_kv_cache_usage --scrape-metric weaver_remote_kv_blocks_used`) and
prints, per run, the hot model's mean running batch, waiting queue, local KV blocks and
lent (remote) blocks in use over the steady window (from --skip-s to the last arrival),
beside its TPOT p50 and its SLO attainment. Where every policy fills the same KV the
policies can only tie; where the batch stops at the TPOT target, the step time's growth
with the batch bounds the rate, whatever the KV. The JSON opens with that verdict.

    python benchmarks/kv_occupancy.py benchmarks/results/goodput/kv_bound_occupancy.json \\
        --local-blocks 16 --out benchmarks/results/goodput/kv_bound_occupancy_summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from weaver.bench.scrape import window_mean
from weaver.results.goodput import Slo, attainment
from weaver.results.records import load_result


def _gauge(run, name: str, hot: str, start_s: float, end_s: float) -> float | None:
    for key, points in run.scraped.items():
        if key.startswith(name + "{") and (f'model="{hot}"' in key or f'hot="{hot}"' in key):
            return window_mean(points, start_s, end_s)
    return None


def summarise(path: Path, hot: str, local_blocks: int, skip_s: float, slo: Slo) -> dict:
    rows = []
    for run in load_result(path).runs:
        if not run.scraped:
            raise SystemExit(f"{path}: run {run.label!r} scraped no gauge; rerun it with "
                             "--scrape-metric (see this script's docstring)")
        end_s = run.last_arrival_s
        mine = [r for r in run.records if r.model == hot]
        tpots = [r.tpot_s for r in mine if r.tpot_s is not None]
        usage = _gauge(run, "weaver_kv_cache_usage", hot, skip_s, end_s)
        rows.append({
            "deployment": run.label, "rate": run.rate,
            "running": _gauge(run, "weaver_num_running", hot, skip_s, end_s),
            "waiting": _gauge(run, "weaver_num_waiting", hot, skip_s, end_s),
            "local_blocks_used": None if usage is None else usage * local_blocks,
            "remote_blocks_used": _gauge(run, "weaver_remote_kv_blocks_used", hot, skip_s,
                                         end_s),
            "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
            "attainment": attainment(mine, slo),
        })
    return {"verdict": _verdict(rows), "window_s": [skip_s, "last arrival"],
            "slo": {"ttft_ms": 1000 * slo.ttft_s, "tpot_ms": 1000 * slo.tpot_s},
            "hot": hot, "local_blocks": local_blocks, "source": str(path), "runs": rows}


def _verdict(rows: list[dict]) -> str:
    by_batch = sorted((r for r in rows if r["running"] is not None and r["tpot_p50_ms"]),
                      key=lambda r: r["running"])
    steps = ", ".join(f"{r['running']:.1f} running: {r['tpot_p50_ms']:.0f} ms"
                      for r in by_batch)
    best = max(rows, key=lambda r: r["attainment"])
    return (f"hot TPOT p50 by mean running batch: {steps}; best attainment "
            f"{100 * best['attainment']:.1f} % ({best['deployment']})")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results file with scraped gauges")
    parser.add_argument("--hot", default="hot", help="the hot model's name (default: hot)")
    parser.add_argument("--local-blocks", type=int, required=True,
                        help="usable KV blocks of the hot engine (its usage gauge is a share)")
    parser.add_argument("--skip-s", type=float, default=20.0,
                        help="seconds of ramp-up left out of the means (default: 20)")
    parser.add_argument("--ttft-slo-ms", type=float, default=10000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=None, help="summary JSON to write")
    args = parser.parse_args(argv)
    slo = Slo(ttft_s=args.ttft_slo_ms / 1000, tpot_s=args.tpot_slo_ms / 1000)
    summary = summarise(args.results, args.hot, args.local_blocks, args.skip_s, slo)
    print("deployment | rate | running | waiting | local blocks | remote blocks | "
          "TPOT p50 ms | attainment")
    for r in summary["runs"]:
        print(f"{r['deployment']} | {r['rate']} | {_fmt(r['running'])} | "
              f"{_fmt(r['waiting'])} | {_fmt(r['local_blocks_used'])} | "
              f"{_fmt(r['remote_blocks_used'])} | {_fmt(r['tpot_p50_ms'], 0)} | "
              f"{100 * r['attainment']:.1f} %")
    print(summary["verdict"])
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
