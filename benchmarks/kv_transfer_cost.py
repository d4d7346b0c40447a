"""What moving a prompt's KV costs in a phase split, against the prompt's length.

Serves a phase-split deployment (default: benchmarks/deployments/splitwise.yaml) and sends
one request at a time, prompt lengths interleaved round by round, each with a few output
tokens. Between two requests the gateway's own counters give that request's transfer
(`weaver_phase_split_kv_*`, weaver/server/phase_split.py):

- save: the prompt engine's time copying the prompt's blocks into the staging segment,
  layer by layer inside its prefill (it lengthens the prefill by that much);
- load: the token engine's time copying them into its cache before its first step (on the
  request's critical path after the prefill);
- the bytes staged (whole blocks: a prompt shorter than a block moves one block).

Beside them, the request's TTFT as the client saw it (prefill + transfer + the token
engine's first step), so the transfer's share of it shows.

    python benchmarks/kv_transfer_cost.py --out benchmarks/results/splitwise/kv_transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request
from pathlib import Path

from weaver.bench.loadgen import LoadGenConfig, run_load_sync
from weaver.bench.prom_histogram import read_counter, read_histogram
from weaver.bench.server_process import weaver_server
from weaver.config.deployment import load_deployment
from weaver.results.records import RequestStatus
from weaver.workloads.types import TraceRequest

REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_DEPLOYMENT = REPOSITORY / "benchmarks" / "deployments" / "splitwise.yaml"
_HISTOGRAMS = {"save_s": "weaver_phase_split_kv_save_seconds",
               "load_s": "weaver_phase_split_kv_load_seconds"}
_COUNTERS = {"staged_bytes": "weaver_phase_split_kv_staged_bytes",
             "loaded_tokens": "weaver_phase_split_kv_transferred_tokens",
             "transfers": "weaver_phase_split_kv_transfers"}


def counters(base_url: str) -> dict[str, float]:
    """The gateway's transfer counters and the sums of its transfer-time histograms."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    out = {key: read_counter(text, name) or 0.0 for key, name in _COUNTERS.items()}
    for key, name in _HISTOGRAMS.items():
        reading = read_histogram(text, name)
        out[key] = reading.sum if reading is not None else 0.0
    return out


def one_request(base_url: str, model: str, prompt_tokens: int, output_tokens: int,
                request_id: int) -> dict:
    before = counters(base_url)
    outcome = run_load_sync([TraceRequest(0.0, prompt_tokens, output_tokens, model,
                                          request_id)],
                            LoadGenConfig(base_url, show_progress=False))
    record, = outcome.records
    if record.status is not RequestStatus.OK:
        raise RuntimeError(f"request of {prompt_tokens} tokens failed: {record.error}")
    after = counters(base_url)
    delta = {key: after[key] - before[key] for key in after}
    if delta["transfers"] != 1:
        raise RuntimeError(f"expected one KV transfer, the counters say {delta['transfers']}")
    return {"prompt_tokens": record.num_prompt_tokens or prompt_tokens,
            "ttft_s": record.ttft_s, **delta}


def summarize(samples: list[dict]) -> list[dict]:
    rows = []
    for length in sorted({s["target_tokens"] for s in samples}):
        group = [s for s in samples if s["target_tokens"] == length]
        save = [s["save_s"] for s in group]
        load = [s["load_s"] for s in group]
        ttft = [s["ttft_s"] for s in group]
        rows.append({
            "target_tokens": length,
            "prompt_tokens": statistics.median(s["prompt_tokens"] for s in group),
            "n": len(group),
            "save_ms_median": statistics.median(save) * 1e3,
            "save_ms_range": [min(save) * 1e3, max(save) * 1e3],
            "load_ms_median": statistics.median(load) * 1e3,
            "load_ms_range": [min(load) * 1e3, max(load) * 1e3],
            "staged_mib": statistics.median(s["staged_bytes"] for s in group) / (1 << 20),
            "ttft_ms_median": statistics.median(ttft) * 1e3,
            "transfer_share_of_ttft": statistics.median(
                (s["save_s"] + s["load_s"]) / s["ttft_s"] for s in group),
        })
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, [r["save_ms_median"] for r in rows], "o-", label="save (prompt engine)")
    ax.plot(tokens, [r["load_ms_median"] for r in rows], "s-", label="load (token engine)")
    ax.plot(tokens, [r["ttft_ms_median"] for r in rows], "^--", label="TTFT")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.set_title("Phase split: KV transfer per request")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployment", type=Path, default=DEFAULT_DEPLOYMENT)
    parser.add_argument("--prompt-tokens", type=int, nargs="+",
                        default=[16, 32, 64, 128, 256, 448])
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="every length once per round")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deployment = load_deployment(args.deployment)
    split, = deployment.phase_split
    args.out.parent.mkdir(parents=True, exist_ok=True)
    samples = []
    ids = iter(range(1 << 40))
    with weaver_server(args.deployment, args.out.with_suffix(".serve.log")) as server:
        one_request(server.base_url, split.model, 32, args.output_tokens, next(ids))  # warm-up
        for round_index in range(args.rounds):
            for length in args.prompt_tokens:
                sample = one_request(server.base_url, split.model, length,
                                     args.output_tokens, next(ids))
                samples.append({"round": round_index, "target_tokens": length, **sample})
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    rows = summarize(samples)
    deployment_path = args.deployment.resolve()
    if deployment_path.is_relative_to(REPOSITORY):
        deployment_path = deployment_path.relative_to(REPOSITORY)
    args.out.write_text(json.dumps({"deployment": str(deployment_path), "model": split.model,
                                    "output_tokens": args.output_tokens, "rows": rows,
                                    "samples": samples}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"{'prompt':>7} {'save ms':>9} {'load ms':>9} {'MiB':>6} {'TTFT ms':>9} {'share':>6}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7.0f} {r['save_ms_median']:>9.2f} {r['load_ms_median']:>9.2f} "
              f"{r['staged_mib']:>6.1f} {r['ttft_ms_median']:>9.1f} "
              f"{r['transfer_share_of_ttft']:>6.1%}")
    print(f"results: {args.out}, plot {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
