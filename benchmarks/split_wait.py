"""Offload wait under a busy cold engine, with and without the operator split plan.

One invocation runs the same workload against two deployments, one after the other, each
in its own `weaver serve`: a SmolLM2 hot engine (core 0) weaving OFFLOAD_RATIO of its
sequences into a SmolLM2 cold engine (core 1) that serves a steady stream of its own
requests, so the offloaded attention tasks arrive while the cold engine is mid-step.

- plain: the cold engine runs its operators whole;
- split: the cold engine runs the plan Algorithm 1 makes from PROFILE at
         --threshold-frac (its chunk counts go into the deployment's `split:`).

Reads the hot side's offload wait (publish -> output observed) from the gateway's
`weaver_offload_wait_seconds` histogram (the requests' share: a scrape before the load is
subtracted): the mean is exact (_sum / _count), p50/p99 are interpolated inside buckets
(weaver/server/weaving.py WAIT_BUCKETS, fine below 10 ms). Prints them for both runs
next to the queueing model's prediction from PROFILE: mean wait = W + N and p99 =
p99 residual + N (W and the residual quantile from weaver/splitting/queueing.py, N the
profiled remote attention; the transport's own latency is not in the model). Also
prints the cold TPOT (the split's cost to the cold model). Writes JSON.

Measure the profile first, with the same deployment settings (about 2-3 minutes):

    python benchmarks/split_wait.py --write-deployment /tmp/split_wait.yaml
    python -m weaver.cli.main plan-split /tmp/split_wait.yaml --measure \\
        --save-profile benchmarks/results/split_profile-smollm2.json
    python benchmarks/split_wait.py --profile benchmarks/results/split_profile-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import httpx  # noqa: E402

from weaver.bench.loadgen import LoadGenConfig, run_load_sync  # noqa: E402
from weaver.bench.server_process import weaver_server  # noqa: E402
from weaver.models.registry import prepare_model  # noqa: E402
from weaver.results.records import RequestStatus  # noqa: E402
from weaver.splitting.algorithm import plan_split  # noqa: E402
from weaver.splitting.profile import SplitProfile  # noqa: E402
from weaver.weaving.plan import lend_kv_gib_for  # noqa: E402
from weaver.workloads.types import TraceRequest  # noqa: E402

BLOCK_SIZE = 32
# SmolLM2: 30 layers x 3 kv heads x block tokens x (K, V) x head 64 x fp32
SMOLLM2_BLOCK_BYTES = 30 * 3 * BLOCK_SIZE * 2 * 64 * 4
LABELS = ("plain", "split")
WAIT_METRIC = "weaver_offload_wait_seconds"


def deployment_yaml(model_dir: Path, args: argparse.Namespace, profile: Path | None,
                    chunks: dict[str, int] | None = None) -> str:
    split = "" if profile is None else f"\n    split: auto\n    split_profile: {profile}"
    if chunks:
        split = f"\n    split: {json.dumps(chunks)}"
    lend_gib = lend_kv_gib_for(args.remote_blocks, SMOLLM2_BLOCK_BYTES)
    return f"""
models:
  - name: hot
    model: {model_dir}
    role: hot
    kv_cache_gib: 0.5
    max_model_len: 1024
    block_size: {BLOCK_SIZE}
    num_gpu_blocks_override: {args.local_blocks + 1}
    max_num_seqs: 64
    cpu_cores: "0"
  - name: cold
    model: {model_dir}
    role: cold
    kv_cache_gib: 0.25
    max_model_len: 1024
    max_num_seqs: 16
    cpu_cores: "1"
    lend_kv_gib: {lend_gib}{split}
weaving: [{{hot: hot, cold: [cold], offload_ratio: {args.offload_ratio}}}]
"""


def workload(args: argparse.Namespace) -> list[TraceRequest]:
    hot = [TraceRequest(0.0, args.hot_input, args.hot_output, "hot", i)
           for i in range(args.num_hot)]
    cold = [TraceRequest(i * args.cold_interval_s, args.cold_input, args.cold_output, "cold",
                         args.num_hot + i) for i in range(args.num_cold)]
    return hot + cold


def wait_histogram(base_url: str) -> dict:
    """Cumulative bucket counts by upper bound, and _sum/_count, of the hot->cold pair."""
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith(WAIT_METRIC) or 'hot="hot"' not in line:
            continue
        value = float(line.split()[-1])
        if line.startswith(f"{WAIT_METRIC}_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets[float("inf") if le == "+Inf" else float(le)] = value
        elif line.startswith(f"{WAIT_METRIC}_sum"):
            total = value
        elif line.startswith(f"{WAIT_METRIC}_count"):
            count = value
    return {"buckets": buckets, "sum": total, "count": count}


def histogram_delta(after: dict, before: dict) -> dict:
    return {"buckets": {le: n - before["buckets"].get(le, 0.0)
                        for le, n in after["buckets"].items()},
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def quantile(hist: dict, q: float) -> float:
    """Linear interpolation inside the bucket that holds the q-quantile (as Prometheus'
    histogram_quantile does)."""
    target = q * hist["count"]
    lower_le, lower_n = 0.0, 0.0
    for le, n in sorted(hist["buckets"].items()):
        if n >= target:
            if le == float("inf"):
                return lower_le
            span = n - lower_n
            return lower_le + (le - lower_le) * ((target - lower_n) / span if span else 1.0)
        lower_le, lower_n = le, n
    return lower_le


def measure(label: str, config: Path, requests: list[TraceRequest]) -> dict:
    with weaver_server(config, config.with_suffix(".log")) as server:
        warm = [TraceRequest(0.0, 8, 4, m, i) for i, m in enumerate(("hot", "cold"))]
        run_load_sync(warm, LoadGenConfig(server.base_url, show_progress=False))
        before = wait_histogram(server.base_url)
        outcome = run_load_sync(requests, LoadGenConfig(server.base_url))
        hist = histogram_delta(wait_histogram(server.base_url), before)
    failed = [r for r in outcome.records if r.status is not RequestStatus.OK]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed: {failed[0].error}")
    if not hist["count"]:
        raise RuntimeError(f"{label}: no offloaded task was recorded; is weaving on? "
                           f"see {config.with_suffix('.log')}")
    cold_tpots = [r.tpot_s for r in outcome.records if r.model == "cold"]
    return {
        "label": label,
        "num_tasks": hist["count"],
        "wait_mean_s": hist["sum"] / hist["count"],
        "wait_p50_s": quantile(hist, 0.50),
        "wait_p99_s": quantile(hist, 0.99),
        "cold_tpot_mean_s": sum(cold_tpots) / len(cold_tpots),
        "histogram": {str(k): v for k, v in sorted(hist["buckets"].items())},
    }


def predictions(profile: SplitProfile, threshold_frac: float) -> dict:
    plan = plan_split(profile.operator_specs(), profile.split_config(threshold_frac))
    n = profile.hot.remote_attention_s
    return {
        "chunks": plan.chunks,
        "remote_attention_s": n,
        "plain": {"W_s": plan.wait_before_s, "wait_mean_s": plan.wait_before_s + n,
                  "wait_p99_s": plan.wait_p99_before_s + n},
        "split": {"W_s": plan.wait_after_s, "wait_mean_s": plan.wait_after_s + n,
                  "wait_p99_s": plan.wait_p99_after_s + n},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path,
                        help="split profile measured with `weaver plan-split --measure` on "
                        "the deployment from --write-deployment")
    parser.add_argument("--write-deployment", type=Path, metavar="YAML",
                        help="only write the split deployment (for measuring the profile)")
    parser.add_argument("--local-blocks", type=int, default=99)
    parser.add_argument("--remote-blocks", type=int, default=189)
    parser.add_argument("--offload-ratio", type=float, default=0.66)
    parser.add_argument("--num-hot", type=int, default=24)
    parser.add_argument("--hot-input", type=int, default=32)
    parser.add_argument("--hot-output", type=int, default=96)
    parser.add_argument("--num-cold", type=int, default=30)
    parser.add_argument("--cold-input", type=int, default=64)
    parser.add_argument("--cold-output", type=int, default=48)
    parser.add_argument("--cold-interval-s", type=float, default=1.0)
    # The paper's 5 % of the hot iteration assumes GPU iteration times (tens of ms). On
    # this CPU a SmolLM2 hot iteration takes ~165 ms, so 5 % (~8 ms) is above every
    # operator but the LM head's W share and Algorithm 1 would split nothing.
    parser.add_argument("--threshold-frac", type=float, default=0.005,
                        help="Algorithm 1's threshold as a fraction of the hot iteration "
                        "(default: %(default)s; see the comment above)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/split_wait.json"))
    args = parser.parse_args()

    # vLLM's worker processes must import this checkout's weaver (not another install).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    model_dir = prepare_model("smollm2-135m-instruct")
    if args.write_deployment:
        args.write_deployment.write_text(deployment_yaml(
            model_dir, args, Path("benchmarks/results/split_profile-smollm2.json").resolve()))
        print(f"wrote {args.write_deployment}")
        return 0
    if args.profile is None or not args.profile.is_file():
        parser.error("--profile PROFILE.json is needed and must exist; measure it first (see "
                     "the commands at the top of this file)")
    profile = SplitProfile.load(args.profile)
    predicted = predictions(profile, args.threshold_frac)
    chunks = {op: n for op, n in predicted["chunks"].items() if n > 1}
    if not chunks:
        parser.error(f"Algorithm 1 splits nothing at --threshold-frac {args.threshold_frac}: "
                     "lower it to compare a split plan with the plain run")
    requests = workload(args)
    work_dir = Path(tempfile.mkdtemp(prefix="weaver-split-wait-"))
    print(f"deployment files and server logs: {work_dir}", flush=True)
    print(f"plan from {args.profile}: {predicted['chunks']}", flush=True)
    runs = []
    for label in LABELS:
        config = work_dir / f"{label}.yaml"
        config.write_text(deployment_yaml(model_dir, args, None,
                                          chunks if label == "split" else None))
        print(f"== {label}", flush=True)
        runs.append(measure(label, config, requests))
    print(f"\n{'run':<6} {'tasks':>6} {'mean us':>9} {'p50 us':>8} {'p99 us':>8} "
          f"{'model mean us':>14} {'model p99 us':>13} {'cold TPOT ms':>13}")
    for run in runs:
        model = predicted[run["label"]]
        print(f"{run['label']:<6} {run['num_tasks']:>6.0f} {run['wait_mean_s'] * 1e6:>9.1f} "
              f"{run['wait_p50_s'] * 1e6:>8.1f} {run['wait_p99_s'] * 1e6:>8.1f} "
              f"{model['wait_mean_s'] * 1e6:>14.1f} {model['wait_p99_s'] * 1e6:>13.1f} "
              f"{run['cold_tpot_mean_s'] * 1e3:>13.1f}")
    plain, split = runs
    print(f"\np99 wait split / plain: {split['wait_p99_s'] / plain['wait_p99_s']:.3f} "
          "(acceptance: < 1)")
    n_s = predicted["remote_attention_s"]
    print(f"W: model {predicted['plain']['W_s'] * 1e6:.1f} -> "
          f"{predicted['split']['W_s'] * 1e6:.1f} us; measured mean - N "
          f"{(plain['wait_mean_s'] - n_s) * 1e6:.1f} -> "
          f"{(split['wait_mean_s'] - n_s) * 1e6:.1f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "args": {k: str(v) for k, v in vars(args).items()}, "profile": profile.model_dump(),
        "predicted": predicted, "runs": runs,
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
