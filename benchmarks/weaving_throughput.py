"""Hot-model throughput and cold-model TPOT: dedicated vs weaving vs an upper bound.

One invocation runs the same KV-bound workload against three deployments, one after the
other, each in its own `weaver serve`:

- dedicated:   the hot engine has LOCAL KV blocks, the cold engine serves alone;
- weaving:     the same, plus REMOTE blocks lent by the cold engine (weaving on), whose
               long operators are split (--cold-split) so a task waits less behind them;
- upper-bound: a dedicated hot engine whose own KV is LOCAL + REMOTE blocks: what the
               extra memory would give with no offload cost;
- weaving-vllm (asked for with --deployments): the weaving pair as two plain `vllm serve`
               processes with Weaver's plugin (docs/weaving.md, "Weaving under plain vllm serve"),
               no gateway: the same engines, hooks and cores, each server's front end on
               the frontend core; the load generator sends each model's requests to its
               own server.

The hot model gets NUM_HOT requests at once (long outputs, ignore_eos) and the cold model
a steady trickle; both engines are pinned to their own core so that the cold core is the
one that also serves offloaded attention. The gateway (`weaver serve`, which streams and
detokenizes every hot token) and this load generator run on the hot engine's core
(--frontend-cores): left to the OS, the gateway ran 12-17 s of a 5-minute run on the
cold core (measured), a cost the cold TPOT paid that belongs to neither engine.
Prints hot output-token throughput and cold TPOT per deployment and the ratios, and
writes JSON. For weaving it also prints the hot side's offload wait and the cold core's
time on offloaded tasks at its poll points per cold output token (from
`weaver_offload_cold_busy_seconds`): the part of the cold TPOT increase that is the
offloaded work itself.

    python benchmarks/weaving_throughput.py --out benchmarks/results/weaving_throughput.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.bench.prom_histogram import read_counter, read_gauge, read_histogram
from weaver.bench.server_process import vllm_cli_env, vllm_server, weaver_server
from weaver.cli.pairs import parse_pairs
from weaver.config.cpu_cores import pin_frontend, pin_process_threads
from weaver.models.registry import prepare_model
from weaver.results.records import RequestStatus
from weaver.splitting.deploy import validate_split_chunks
from weaver.weaving.plan import lend_kv_gib_for
from weaver.workloads.types import TraceRequest

BLOCK_SIZE = 32
# SmolLM2: 30 layers × 3 kv heads × block tokens × (K, V) × head 64 × fp32
SMOLLM2_BLOCK_BYTES = 30 * 3 * BLOCK_SIZE * 2 * 64 * 4
DEPLOYMENTS = ("dedicated", "weaving", "upper-bound")
EXTRA_DEPLOYMENTS = ("weaving-vllm",)
PAIR = "bench"


def deployment_yaml(label: str, model_dir: Path, local_blocks: int, remote_blocks: int,
                    ratio: float, cold_split: dict[str, int] | None = None) -> str:
    hot_role, weaving, lend = "dedicated", "[]", ""
    hot_blocks = local_blocks + 1  # + vLLM's null block
    if label == "weaving":
        hot_role = "hot"
        # Exactly REMOTE blocks: one short makes a remote sequence preempt near its end.
        lend = f"\n    lend_kv_gib: {lend_kv_gib_for(remote_blocks, SMOLLM2_BLOCK_BYTES)}"
        if cold_split:
            lend += f"\n    split: {json.dumps(cold_split)}"
        weaving = f"[{{hot: hot, cold: [cold], offload_ratio: {ratio}}}]"
    elif label == "upper-bound":
        hot_blocks += remote_blocks
    return f"""
models:
  - name: hot
    model: {model_dir}
    role: {hot_role}
    kv_cache_gib: 0.5
    max_model_len: 1024
    block_size: {BLOCK_SIZE}
    num_gpu_blocks_override: {hot_blocks}
    max_num_seqs: 64
    cpu_cores: "0"
  - name: cold
    model: {model_dir}
    role: {"cold" if label == "weaving" else "dedicated"}
    kv_cache_gib: 0.25
    max_model_len: 1024
    cpu_cores: "1"{lend}
weaving: {weaving}
"""


def vllm_serve_args(side: str, local_blocks: int, remote_blocks: int, ratio: float,
                    cold_split: dict[str, int] | None) -> list[str]:
    """The `vllm serve` flags of the weaving deployment's hot or cold engine (what `weaver
    config --engines` prints for it), with the pair given as a `weaver` block."""
    lend = float(lend_kv_gib_for(remote_blocks, SMOLLM2_BLOCK_BYTES))
    common = ["--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
              "--max-num-seqs", "64", "--disable-uvicorn-access-log"]
    if side == "hot":
        block = {"role": "hot", "pair": PAIR, "remote_kv_gib": lend, "offload_ratio": ratio}
        return ["--served-model-name", "hot", *common, "--block-size", str(BLOCK_SIZE),
                "--num-gpu-blocks-override", str(local_blocks + 1),
                "--kv-cache-memory-bytes", str(1 << 29),
                "--additional-config", json.dumps({"weaver": block})]
    block = {"role": "cold", "pair": PAIR, "lend_kv_gib": lend}
    if cold_split:
        block["split"] = cold_split
    return ["--served-model-name", "cold", *common, "--kv-cache-memory-bytes", str(1 << 28),
            "--additional-config", json.dumps({"weaver": block})]


@contextlib.contextmanager
def vllm_pair(work_dir: Path, model_dir: Path, args: argparse.Namespace,
              cold_split: dict[str, int] | None):
    """The weaving pair as two `vllm serve` processes, linked; yields (hot, cold)."""
    env = {**vllm_cli_env(work_dir / "shim"), "WEAVER_RUNTIME_DIR": str(work_dir / "runtime")}
    with contextlib.ExitStack() as stack:
        servers = {}
        for side, core in (("cold", 1), ("hot", 0)):
            servers[side] = stack.enter_context(vllm_server(
                str(model_dir), work_dir / f"weaving-vllm-{side}.log",
                *vllm_serve_args(side, args.local_blocks, args.remote_blocks,
                                 args.offload_ratio, cold_split),
                env_overrides={**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}))
            # As weaver serve pins each engine's scheduler process to the engine's core
            # (its worker binds its own threads); the front end stays on the frontend core.
            for child in psutil.Process(servers[side].process.pid).children():
                if "EngineCore" in " ".join(child.cmdline()):
                    pin_process_threads(child.pid, frozenset({core}))
        yield servers["hot"], servers["cold"]


def _wait_pair_connected(hot, timeout_s: float = 120) -> None:
    """The hot side links on its scheduler's steps: warm-up requests until it has."""
    deadline = time.monotonic() + timeout_s
    while read_gauge(httpx.get(f"{hot.base_url}/metrics", timeout=30).text,
                     "weaver_pair_connected") != 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vllm serve pair did not connect:\n{hot.log_tail()}")
        run_load_sync([TraceRequest(0.0, 8, 4, "hot", 0)],
                      LoadGenConfig(hot.base_url, show_progress=False))
        time.sleep(1.5)  # its counters are published every second


def measure_vllm_pair(work_dir: Path, model_dir: Path, args: argparse.Namespace,
                      cold_split: dict[str, int] | None, requests: list[TraceRequest]) -> dict:
    with vllm_pair(work_dir, model_dir, args, cold_split) as (hot, cold):
        for server, model in ((hot, "hot"), (cold, "cold")):
            run_load_sync([TraceRequest(0.0, 8, 4, model, 0)],
                          LoadGenConfig(server.base_url, show_progress=False))
        _wait_pair_connected(hot)
        # Each model's requests to its own server, both runs started together.
        with cf.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_load_sync, [r for r in requests if r.model == model],
                                LoadGenConfig(server.base_url, show_progress=model == "hot"))
                    for server, model in ((hot, "hot"), (cold, "cold"))]
            records = [record for run in runs for record in run.result().records]
        hot_text = httpx.get(f"{hot.base_url}/metrics", timeout=30).text
        cold_text = httpx.get(f"{cold.base_url}/metrics", timeout=30).text
        busy = {where: read_counter(cold_text, "weaver_offload_cold_busy_seconds",
                                    {"where": where}) for where in ("poll_point", "idle")}
        pair = {"sequences": read_counter(hot_text, "weaver_offload_sequences"),
                "tasks": read_counter(hot_text, "weaver_offload_tasks"),
                "fallbacks": read_counter(hot_text, "weaver_offload_fallbacks")}
    return summarize_records("weaving-vllm", records, None, busy, {"vllm_serve_pair": pair})


def workload(args: argparse.Namespace) -> list[TraceRequest]:
    hot = [TraceRequest(0.0, args.hot_input, args.hot_output, "hot", i)
           for i in range(args.num_hot)]
    cold = [TraceRequest(args.cold_start_s + i * args.cold_interval_s, args.cold_input,
                         args.cold_output, "cold", args.num_hot + i)
            for i in range(args.num_cold)]
    return hot + cold


def measure(label: str, config: Path, requests: list[TraceRequest]) -> dict:
    with weaver_server(config, config.with_suffix(".log")) as server:
        warm = [TraceRequest(0.0, 8, 4, m, i) for i, m in enumerate(("hot", "cold"))]
        run_load_sync(warm, LoadGenConfig(server.base_url, show_progress=False))
        outcome = run_load_sync(requests, LoadGenConfig(server.base_url))
        health = server.health().json()
        metrics_text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        wait = read_histogram(metrics_text, "weaver_offload_wait_seconds")
        busy = {where: read_counter(metrics_text, "weaver_offload_cold_busy_seconds",
                                    {"where": where}) for where in ("poll_point", "idle")}
    return summarize_records(label, outcome.records, wait, busy,
                             {"weaving": health.get("weaving")})


def summarize_records(label: str, records: list, wait, busy: dict, extra: dict) -> dict:
    hot = [r for r in records if r.model == "hot"]
    cold = [r for r in records if r.model == "cold"]
    failed = [r for r in records if r.status is not RequestStatus.OK]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed: {failed[0].error}")
    hot_span = max(r.sent_at_s + r.e2e_s for r in hot) - min(r.sent_at_s for r in hot)
    cold_tpots = sorted(r.tpot_s for r in cold)
    cold_tokens = sum(r.num_output_tokens for r in cold)
    return {
        "label": label,
        "hot_output_tokens": sum(r.num_output_tokens for r in hot),
        "hot_span_s": hot_span,
        "hot_throughput_tok_s": sum(r.num_output_tokens for r in hot) / hot_span,
        "cold_tpot_mean_s": sum(cold_tpots) / len(cold_tpots),
        "cold_tpot_p50_s": cold_tpots[len(cold_tpots) // 2],
        **extra,
        # The hot side's wait for each offloaded layer (after its local attention).
        "offload_wait": None if wait is None or not wait.count else {
            "num_tasks": wait.count, "mean_s": wait.mean, "p50_s": wait.quantile(0.5),
            "p99_s": wait.quantile(0.99)},
        # The cold core's time on the hot model's tasks. At poll points it lands inside the
        # cold model's own steps, so per cold output token it is what weaving adds to the
        # cold TPOT by work alone (its batches are mostly one request here).
        "cold_busy_s": None if busy["poll_point"] is None else busy,
        "cold_busy_at_poll_points_per_cold_token_s": (
            None if busy["poll_point"] is None else busy["poll_point"] / cold_tokens),
    }


def _print_run(run: dict, with_round: bool = False) -> None:
    wait = run["offload_wait"]
    wait_text = "-" if wait is None else f"{wait['mean_s'] * 1e3:.2f} / {wait['p99_s'] * 1e3:.2f}"
    busy = run.get("cold_busy_at_poll_points_per_cold_token_s")
    busy_text = "-" if busy is None else f"{busy * 1e3:.1f}"
    prefix = f"{run['round']:<6} " if with_round else ""
    print(f"{prefix}{run['label']:<12} {run['hot_throughput_tok_s']:>10.1f} "
          f"{run['cold_tpot_mean_s'] * 1e3:>13.1f} {wait_text:>25} {busy_text:>22}",
          flush=True)


def _ratio_text(ratio: float | None) -> str:
    return "n/a (the upper bound gained nothing)" if ratio is None else f"{ratio:.2f}"


def summarize_rounds(runs: list[dict]) -> dict:
    """Per round and over rounds: the gains over dedicated, their ratio (weaving's gain /
    the upper bound's) and cold TPOT's ratio, by three estimators.

    - medians: each deployment's median over rounds, then the ratios (robust to one slow
      run; the headline figures);
    - per-round ratios, then their median (pairs runs minutes apart, but a ratio whose
      denominator, the upper bound's gain, is near zero in a slow round swings wildly);
    - pooled means: the ratio of gains from each deployment's mean, and the weaving cold
      TPOT against the mean of every unweaved cold run (the upper-bound deployment's cold
      engine serves alone too, so each round has two unweaved samples)."""
    def gains(tok_s: dict[str, float], tpot: dict[str, float]) -> dict[str, float | None]:
        weave = tok_s["weaving"] / tok_s["dedicated"] - 1
        upper = tok_s["upper-bound"] / tok_s["dedicated"] - 1
        return {"weaving_gain": weave, "upper_bound_gain": upper,
                "ratio_of_gains": weave / upper if upper else None,
                "cold_tpot_ratio": tpot["weaving"] / tpot["dedicated"]}

    def per_label(key: str, average) -> dict[str, float]:
        return {label: average([r[key] for r in runs if r["label"] == label])
                for label in DEPLOYMENTS}

    rounds = sorted({r["round"] for r in runs})
    per_round = []
    for index in rounds:
        mine = {r["label"]: r for r in runs if r["round"] == index}
        per_round.append({"round": index, **gains(
            {k: v["hot_throughput_tok_s"] for k, v in mine.items()},
            {k: v["cold_tpot_mean_s"] for k, v in mine.items()})})
    median_tok_s = per_label("hot_throughput_tok_s", statistics.median)
    median_tpot = per_label("cold_tpot_mean_s", statistics.median)
    overall = gains(median_tok_s, median_tpot)
    mean_tok_s = per_label("hot_throughput_tok_s", statistics.fmean)
    pooled = gains(mean_tok_s, per_label("cold_tpot_mean_s", statistics.fmean))
    unweaved_tpot = statistics.fmean(r["cold_tpot_mean_s"] for r in runs
                                     if r["label"] in ("dedicated", "upper-bound"))
    weaving_tpot = statistics.fmean(r["cold_tpot_mean_s"] for r in runs
                                    if r["label"] == "weaving")
    round_ratios = [r["ratio_of_gains"] for r in per_round if r["ratio_of_gains"] is not None]
    extra = {}
    if any(r["label"] == "weaving-vllm" for r in runs):
        # The same gains with the pair launched by two vllm serve processes (medians).
        vllm_tok_s = {**median_tok_s, "weaving": statistics.median(
            r["hot_throughput_tok_s"] for r in runs if r["label"] == "weaving-vllm")}
        vllm_tpot = {**median_tpot, "weaving": statistics.median(
            r["cold_tpot_mean_s"] for r in runs if r["label"] == "weaving-vllm")}
        extra["vllm_serve_pair"] = gains(vllm_tok_s, vllm_tpot)
    return {**extra, "rounds": per_round, "median_hot_tok_s": median_tok_s,
            "median_cold_tpot_s": median_tpot,
            "weaving_gain": overall["weaving_gain"],
            "upper_bound_gain": overall["upper_bound_gain"],
            "weaving_gain_over_upper_bound_gain": overall["ratio_of_gains"],
            "cold_tpot_weaving_over_dedicated": overall["cold_tpot_ratio"],
            "median_of_round_ratios_of_gains": (statistics.median(round_ratios)
                                                if round_ratios else None),
            "median_of_round_cold_tpot_ratios": statistics.median(
                r["cold_tpot_ratio"] for r in per_round),
            "mean_hot_tok_s": mean_tok_s,
            "ratio_of_gains_of_means": pooled["ratio_of_gains"],
            "cold_tpot_weaving_over_unweaved_mean": weaving_tpot / unweaved_tpot}


def hot_capacity(args: argparse.Namespace) -> dict[str, int]:
    """How many hot requests each deployment's KV holds at their full length (KV blocks /
    blocks a request needs). vLLM admits more at first, while prompts are short, and
    preempts (recomputes) the latest as they grow: this is the batch it settles at."""
    per_request = -(-(args.hot_input + args.hot_output) // BLOCK_SIZE)
    local = args.local_blocks // per_request
    return {"dedicated": local,
            "weaving": local + args.remote_blocks // per_request,
            "upper-bound": (args.local_blocks + args.remote_blocks) // per_request}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-blocks", type=int, default=99,
                        help="hot engine's own KV blocks (99 = 11 requests of 9 blocks)")
    parser.add_argument("--remote-blocks", type=int, default=189,
                        help="blocks the cold engine lends (189 = 21 requests)")
    parser.add_argument("--offload-ratio", type=float, default=0.66)
    parser.add_argument("--num-hot", type=int, default=32,
                        help="hot requests, all sent at once")
    parser.add_argument("--hot-input", type=int, default=32)
    parser.add_argument("--hot-output", type=int, default=256)
    parser.add_argument("--num-cold", type=int, default=12)
    parser.add_argument("--cold-input", type=int, default=32)
    parser.add_argument("--cold-output", type=int, default=32)
    parser.add_argument("--cold-start-s", type=float, default=5.0)
    parser.add_argument("--cold-interval-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/weaving_throughput.json"))
    parser.add_argument(
        "--cold-split", nargs="*", default=["lm_head=16"], metavar="OP=CHUNKS",
        help="operator splitting of the cold model in the weaving deployment (Weaver's "
        "second mechanism: a task waits behind one chunk, not a whole operator). The "
        "default cuts SmolLM2's LM head (~15 ms on one core here, 80 %% of the expected "
        "wait: benchmarks/results/split_profile-smollm2.json) into 16; give no value to "
        "weave without splitting")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved repetitions of all deployments; figures are the "
                        "medians over rounds (each round is about 7 minutes)")
    parser.add_argument("--frontend-cores", default="0",
                        help="cores for the gateway and the load generator, in cpu_cores "
                        "syntax ('0-1' leaves them to the OS)")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS),
                        choices=DEPLOYMENTS + EXTRA_DEPLOYMENTS,
                        help="which to run (default: the first three; weaving-vllm runs the "
                        "weaving pair as two plain vllm serve processes)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    try:
        cold_split = {op: int(n) for op, n in parse_pairs(args.cold_split, "--cold-split").items()}
        validate_split_chunks(cold_split)
    except ValueError as exc:
        parser.error(str(exc))

    try:
        frontend_cores = pin_frontend("--frontend-cores", args.frontend_cores)
    except ValueError as exc:
        parser.error(str(exc))
    if frontend_cores is not None:
        print(f"gateway and load generator on cores {sorted(frontend_cores)}", flush=True)

    model_dir = prepare_model("smollm2-135m-instruct")
    requests = workload(args)
    capacity = hot_capacity(args)
    print("hot requests the KV holds at full length: " + ", ".join(
        f"{label} {n}" for label, n in capacity.items()), flush=True)
    runs = []
    # Kept after the run: each deployment's YAML and server log, for a look afterwards.
    work_dir = Path(tempfile.mkdtemp(prefix="weaver-bench-"))
    print(f"deployment files and server logs: {work_dir}", flush=True)
    for label in set(args.deployments) & set(DEPLOYMENTS):
        (work_dir / f"{label}.yaml").write_text(deployment_yaml(
            label, model_dir, args.local_blocks, args.remote_blocks, args.offload_ratio,
            cold_split))
    # Rounds interleave the deployments (D W U D W U ...): this machine's speed drifts by
    # 10-30 % over minutes, which a single pass turns into a bias of whichever ran when.
    for round_index in range(args.rounds):
        for label in args.deployments:
            print(f"== round {round_index + 1}/{args.rounds}: {label}", flush=True)
            if label == "weaving-vllm":
                run = measure_vllm_pair(work_dir, model_dir, args, cold_split, requests)
            else:
                run = measure(label, work_dir / f"{label}.yaml", requests)
            run["round"] = round_index + 1
            runs.append(run)
            _print_run(run)
    summary = summarize_rounds(runs) if set(DEPLOYMENTS) <= set(args.deployments) else None
    print(f"\n{'round':<6} {'deployment':<12} {'hot tok/s':>10} {'cold TPOT ms':>13} "
          f"{'offload wait mean/p99 ms':>25} {'cold ms/token on tasks':>22}")
    for run in runs:
        _print_run(run, with_round=True)
    if summary is not None:
        for entry in summary["rounds"]:
            print(f"round {entry['round']}: weaving gain {entry['weaving_gain']:+.1%}, upper "
                  f"bound {entry['upper_bound_gain']:+.1%}, ratio of gains "
                  f"{_ratio_text(entry['ratio_of_gains'])}, cold TPOT "
                  f"x{entry['cold_tpot_ratio']:.3f}")
        print(f"\nmedian over {args.rounds} round(s): hot tok/s dedicated "
              f"{summary['median_hot_tok_s']['dedicated']:.1f}, weaving "
              f"{summary['median_hot_tok_s']['weaving']:.1f}, upper bound "
              f"{summary['median_hot_tok_s']['upper-bound']:.1f}")
        print(f"hot gain: weaving {summary['weaving_gain']:+.1%}, upper bound "
              f"{summary['upper_bound_gain']:+.1%}, ratio of gains "
              f"{_ratio_text(summary['weaving_gain_over_upper_bound_gain'])} (target >= 0.85)")
        print(f"cold TPOT weaving / dedicated: {summary['cold_tpot_weaving_over_dedicated']:.3f}"
              " (target <= 1.10)")
        if "vllm_serve_pair" in summary:
            same = summary["vllm_serve_pair"]
            print(f"the pair as two vllm serve processes: hot gain {same['weaving_gain']:+.1%}, "
                  f"ratio of gains {_ratio_text(same['ratio_of_gains'])}, cold TPOT "
                  f"x{same['cold_tpot_ratio']:.3f} (weaver serve: ratio of gains "
                  f"{_ratio_text(summary['weaving_gain_over_upper_bound_gain'])})")
        print(f"other estimators: median of per-round ratios of gains "
              f"{_ratio_text(summary['median_of_round_ratios_of_gains'])}, cold TPOT "
              f"{summary['median_of_round_cold_tpot_ratios']:.3f}; ratio of gains of the "
              f"means {_ratio_text(summary['ratio_of_gains_of_means'])}; weaving cold TPOT / "
              f"mean of the {2 * len(summary['rounds'])} unweaved cold runs "
              f"{summary['cold_tpot_weaving_over_unweaved_mean']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "args": {k: str(v) for k, v in vars(args).items()}, "hot_capacity": capacity,
        "runs": runs, "summary": summary,
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
