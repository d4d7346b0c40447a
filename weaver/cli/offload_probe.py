"""`weaver offload-probe`: measure the CPU offload channel between two processes.

Heavy imports (torch, the probe) happen inside the handler so `weaver --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

_DESCRIPTION = (
    "Start a cold process that owns a shared-memory offload region and serves tasks from "
    "its idle poller; submit decode-attention tasks from this (hot) process and record, per "
    "task, the time inside submit() and the round trip (publish -> output visible), plus "
    "the cost of one idle poll point. "
    "With --executor noop the numbers are the channel alone (copies, counters, doorbells); "
    "vllm adds vLLM's CPU attention kernel, reference the pure-torch oracle. Results are "
    "written as JSON; --plot draws a histogram from that JSON file."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from weaver.profiling.probe_config import EXECUTORS, ProbeConfig

    parser = subparsers.add_parser(
        "offload-probe",
        help="measure offload-channel round-trip latency between two processes",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    helps = {
        "num_layers": "hot-model layers in the region (tasks cycle through them)",
        "num_q_heads": "hot-model query heads",
        "num_kv_heads": "hot-model KV heads",
        "head_size": "hot-model head size",
        "block_size": "KV block size in tokens (vLLM CPU_ATTN needs a multiple of 32)",
        "dtype": "region dtype: float32, float16 or bfloat16",
        "num_seqs": "remote sequences per task",
        "seq_len": "context length of every remote sequence, in tokens",
        "num_tasks": "measured tasks",
        "num_warmup_tasks": "tasks run before measuring",
        "executor": f"what the cold side runs per task: one of {', '.join(EXECUTORS)}",
        "num_idle_polls": "poll() calls timed with nothing pending",
        "shm_prefix": "prefix of the shared-memory region name",
        "shm_dir": "directory of POSIX shared memory",
        "seed": "random seed of q and the KV pool",
    }
    for f in fields(ProbeConfig):
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(default=f.default, help=helps[f.name])
        if f.name == "executor":
            kwargs["choices"] = EXECUTORS
        if f.name == "dtype":
            kwargs["choices"] = ("float32", "float16", "bfloat16")
        parser.add_argument(flag, type=type(f.default), **kwargs)
    parser.add_argument("--output", required=True, help="JSON file to write the results to")
    parser.add_argument("--plot", default=None, help="PNG to draw from the saved JSON")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weaver.profiling.channel_probe import run_probe
    from weaver.profiling.probe_config import ProbeConfig

    try:
        config = ProbeConfig(**{f.name: getattr(args, f.name) for f in fields(ProbeConfig)})
        config.layout  # noqa: B018  # validates the shape before a process is started
    except ValueError as err:
        print(f"weaver offload-probe: error: {err}", file=sys.stderr)
        return 2
    results = run_probe(config, executor_factory(config.executor),
                        show_progress=not args.no_progress)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    rt = results["round_trip_us"]
    print(
        f"round trip over {config.num_tasks} tasks ({config.executor} executor): "
        f"p50 {rt['p50']:.1f} us, p90 {rt['p90']:.1f} us, p99 {rt['p99']:.1f} us, "
        f"max {rt['max']:.1f} us; submit p50 {results['submit_us']['p50']:.1f} us; "
        f"submit+round trip p50 {results['total_us']['p50']:.1f} us, "
        f"p99 {results['total_us']['p99']:.1f} us; "
        "answered while spinning "
        f"{results['fraction_answered_while_spinning']:.0%}; idle poll "
        f"{results['idle_poll_ns']:.0f} ns; wrote {args.output}"
    )
    if args.plot:
        plot_from_json(args.output, args.plot)
        print(f"wrote {args.plot}")
    return 0


def executor_factory(name: str):
    """The cold side's executor for --executor NAME (vllm imports vLLM, in the cold process
    only: the factory crosses the spawn by reference)."""
    from weaver.profiling import channel_probe

    if name == "vllm":
        from weaver.vllm_ext.attention.cpu_kernels import CpuPagedAttentionExecutor

        return CpuPagedAttentionExecutor
    return channel_probe.reference_executor if name == "reference" else channel_probe.noop_executor


def plot_from_json(json_path: str, png_path: str) -> None:
    """Histogram of round-trip times, drawn only from a saved results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        results = json.load(f)
    samples = results["round_trip_samples_us"]
    config = results["config"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Log-spaced bins: a few scheduler hiccups are 1000x the median on a shared box.
    low, high = max(min(samples), 1e-3), max(samples)
    ratio = (high / low) ** (1 / 50) if high > low else 2.0
    ax.hist(samples, bins=[low * ratio**i for i in range(51)] if high > low else 10)
    ax.set_xscale("log")
    for key, style in (("p50", "-"), ("p99", "--")):
        value = results["round_trip_us"][key]
        ax.axvline(value, color="k", linestyle=style, label=f"{key} {value:.0f} us")
    ax.set_xlabel("round trip per task (us, log scale)")
    ax.set_ylabel("tasks")
    ax.set_title(
        f"offload channel, {config['executor']} executor, {config['num_seqs']} seqs x "
        f"{config['seq_len']} tokens"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
