"""How much slower a colocated engine's steps run while the other engine of its group is busy.

Serves a mux deployment (default: benchmarks/deployments/mux_temporal.yaml) and reads the
group's own counters from the gateway's /metrics (`weaver_mux_steps_total`,
`weaver_mux_step_seconds_total`: steps, and the time they held their turn) over phases:

- ``alone``: B requests to the first model, the other engine idle;
- ``both``: B requests to each model at once, so the engines take turns all along.

A step's mean time is step seconds / steps within the phase. In temporal mode the steps
never overlap, so `both / alone` is what the other engine's processes cost a step beside
it (its scheduler, frontend and idle worker share the group's cores), not a share of the
compute. The simulator takes it as `muxserve.contended_speed` (weaver/sim/config.py).

    python benchmarks/mux_contention.py --out benchmarks/results/mux_contention.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.bench.server_process import weaver_server
from weaver.config.deployment import load_deployment
from weaver.results.records import RequestStatus
from weaver.workloads.types import TraceRequest

REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_DEPLOYMENT = REPOSITORY / "benchmarks" / "deployments" / "mux_temporal.yaml"
_SAMPLE = re.compile(r'^(weaver_mux_steps_total|weaver_mux_step_seconds_total)\{([^}]*)\} (\S+)$')


def mux_counters(base_url: str) -> dict[str, dict[str, float]]:
    """{model: {"steps": n, "seconds": s}} of every mux group, from /metrics."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        entry = out.setdefault(labels["model"], {"steps": 0.0, "seconds": 0.0})
        key = "steps" if match.group(1) == "weaver_mux_steps_total" else "seconds"
        entry[key] += float(match.group(3))
    return out


def phase(base_url: str, requests: list[TraceRequest]) -> dict[str, dict[str, float]]:
    """Send `requests` at once; each model's steps, step seconds and mean step in between."""
    before = mux_counters(base_url)
    outcome = run_load_sync(requests, LoadGenConfig(base_url, show_progress=False))
    bad = [r for r in outcome.records if r.status is not RequestStatus.OK]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
    after = mux_counters(base_url)
    out = {}
    for model, counts in after.items():
        steps = counts["steps"] - before.get(model, {}).get("steps", 0.0)
        seconds = counts["seconds"] - before.get(model, {}).get("seconds", 0.0)
        if steps:
            out[model] = {"steps": steps, "seconds": seconds, "mean_step_s": seconds / steps}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployment", type=Path, default=DEFAULT_DEPLOYMENT)
    parser.add_argument("--batch", type=int, default=4, help="requests per model (B)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alone/both pairs, interleaved")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deployment = load_deployment(args.deployment)
    (group,) = deployment.mux
    first, other = group.models[0], group.models[1]
    ids = iter(range(1 << 40))

    def batch(model: str) -> list[TraceRequest]:
        return [TraceRequest(0.0, args.prompt_tokens, args.output_tokens, model, next(ids))
                for _ in range(args.batch)]

    log = args.out.with_suffix(".serve.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    phases = []
    with weaver_server(args.deployment, log) as server:
        phase(server.base_url, batch(first) + batch(other))  # warm-up
        for repeat in range(args.repeats):
            for name, requests in (("alone", batch(first)),
                                   ("both", batch(first) + batch(other))):
                started = time.monotonic()
                seen = phase(server.base_url, requests)
                phases.append({"repeat": repeat, "phase": name, "models": seen,
                               "wall_s": time.monotonic() - started})
                print(f"repeat {repeat + 1} {name:<5} " + "  ".join(
                    f"{m}: {v['steps']:.0f} steps, mean {v['mean_step_s'] * 1e3:.1f} ms"
                    for m, v in seen.items()), flush=True)
    alone = [p["models"][first]["mean_step_s"] for p in phases if p["phase"] == "alone"]
    both = [p["models"][first]["mean_step_s"] for p in phases if p["phase"] == "both"]
    ratios = [b / a for a, b in zip(alone, both, strict=True)]
    deployment_path = args.deployment.resolve()
    if deployment_path.is_relative_to(REPOSITORY):
        deployment_path = deployment_path.relative_to(REPOSITORY)
    result = {"deployment": str(deployment_path), "mode": group.mode, "model": first,
              "batch": args.batch, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "phases": phases,
              "step_ratio_both_over_alone": ratios,
              "contended_speed": 1 / statistics.fmean(ratios)}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{first}'s mean step, other engine busy / idle: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; contended_speed "
          f"{result['contended_speed']:.2f}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
