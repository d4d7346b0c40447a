"""`weaver bench`: trace-driven benchmarks against running OpenAI-compatible servers.

  weaver bench run      send a workload (Azure conv/code or BurstGPT) to one server, or
                        to a deployment it starts (--config); `weaver bench --config D
                        ...` is short for `weaver bench run --config D ...`
  weaver bench compare  send the same workload to several servers, print ratios
  weaver bench goodput  search each deployment's goodput (max rate within the SLO), ratios
  weaver bench goodput-grid
                        a goodput search's ratios again under a grid of SLOs
  weaver bench summary  print tables from saved results
  weaver bench plot     draw TPOT-vs-rate and throughput figures from saved results
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

from weaver.cli.command_groups import require_command
from weaver.cli.pairs import parse_pairs

logger = logging.getLogger(__name__)

API_KEY_ENV = "OPENAI_API_KEY"
# The synthetic prompt of N words tokenizes to about N tokens plus BOS/special tokens; keep
# this many tokens free under --max-model-len so that no request is rejected as too long.
PROMPT_TOKEN_MARGIN = 4
COMMAND = "bench"
DEFAULT_ACTION = "run"  # `weaver bench --config D ...` (weaver.cli.main)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        COMMAND,
        help="trace-driven benchmarks against running servers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="bench commands", metavar="BENCH_COMMAND")
    require_command(parser)
    _register_run(commands)
    _register_compare(commands)
    _register_goodput(commands)
    _register_goodput_grid(commands)
    _register_summary(commands)
    _register_plot(commands)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--model", action="append", required=True,
        metavar="NAME[=RATE[@ON/OFF]] | NAME=same:OTHER",
        help="a served model name, optionally with its own rate in req/s; repeat for several "
        "models (rates for all or for none; with none, --rate is split by --power-law-alpha). "
        "@ON/OFF sends at RATE for ON seconds, then nothing for OFF seconds, over and over "
        "(e.g. hot=0.5@60/60): another model's latency with and without this one's load, "
        "interleaved in one run. NAME=same:OTHER sends NAME a copy of OTHER's requests (same "
        "arrival times and lengths, on top of --num-requests): two setups served side by side "
        "see the same load (benchmarks/side_by_side.py)",
    )
    g.add_argument(
        "--trace", default="azure-conv", metavar="azure-conv|azure-code|burstgpt:PATH",
        help="request lengths (and, with --arrival trace, arrival times) come from this trace "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--traces-dir", default=None,
        help="folder with the Azure CSVs (default: $WEAVER_TRACES_DIR, else the copies shipped "
             "with Weaver)",
    )
    g.add_argument(
        "--filter", dest="filter_name", default=None, choices=["weaver-azure", "burstgpt", "none"],
        help="row filter (default: the Weaver paper's rule for the trace: in+out < 2000 tokens; "
        "BurstGPT also keeps GPT-4 rows with > 3 response tokens)",
    )
    g.add_argument(
        "--rate", type=float, nargs="+", default=None, metavar="R",
        help="total request rate in req/s; several values run a sweep into one results file",
    )
    g.add_argument(
        "--arrival", choices=["poisson", "gamma", "trace"], default="poisson",
        help="arrival process; `trace` replays the trace's timestamps, stretched to --rate if "
        "given (default: %(default)s)",
    )
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier (default: %(default)s)")
    g.add_argument("--time-scale", type=float, default=None,
                   help="with --arrival trace: multiply the trace's gaps by this factor")
    g.add_argument("--power-law-alpha", type=float, default=0.0,
                   help="MuxServe popularity: model i gets rate ~ i^-alpha (default: even split)")
    g.add_argument("--num-requests", type=int, default=200,
                   help="requests per run (default: %(default)s)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply input and output lengths by this factor (default: 1)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="shrink requests so that input + output fits this context length, "
                   f"less {PROMPT_TOKEN_MARGIN} tokens for the BOS and tokenizer drift of the "
                   "synthetic prompt")
    g.add_argument("--seed", type=int, default=0,
                   help="the one seed of the workload (default: %(default)s)")


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("client")
    g.add_argument("--duration-s", type=float, default=None,
                   help="deadline per run; outstanding requests are then cancelled and "
                   "counted as unfinished")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    g.add_argument("--api-key", default=None,
                   help=f"bearer token (default: ${API_KEY_ENV} if set)")
    g.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="per-request HTTP timeout (default: %(default)s)")
    g.add_argument("--no-vllm-extras", action="store_true",
                   help="do not send ignore_eos/min_tokens (for non-vLLM servers)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument("--scrape-metric", action="append", default=[], metavar="GAUGE",
                   help="sample this gauge of the server's /metrics during each run and keep "
                   "it in the results (repeat for more; e.g. weaver_num_running, "
                   "weaver_kv_cache_usage, weaver_remote_kv_blocks_used); the run's mean "
                   "of each is printed")
    g.add_argument("--scrape-interval-s", type=float, default=1.0,
                   help="seconds between two scrapes of /metrics (default: %(default)s)")
    g.add_argument("--frontend-cores", default=None, metavar="CORES",
                   help="pin this load generator and the `weaver serve` it starts to these "
                   "cores (VLLM_CPU_OMP_THREADS_BIND syntax: '0', '0-3'); the engines then "
                   "pin themselves to their own cpu_cores. On a CPU testbed give the hot "
                   "engines' cores, so that the cold engine's core, which stands for its GPU, "
                   "runs nothing but the cold engine (default: left to the OS)")
    g = parser.add_argument_group("SLOs")
    g.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="TTFT target of the SLO, in ms (a request meets the SLO when it "
                   "finishes within both targets; weaver/results/goodput.py)")
    g.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="TPOT target of the SLO, in ms")
    g.add_argument("--isolated-from", default=None, metavar="RESULTS.json",
                   help="fit each model's isolated TTFT/TPOT from a low-load run saved here, "
                   "for MuxServe SLO attainment (x5, x8) and slowdowns")
    g.add_argument("--isolated", action="append", default=[], metavar="MODEL=TTFT_MS,TPOT_MS",
                   help="isolated latency constants of a model instead of --isolated-from")
    g.add_argument("--role", action="append", default=[], metavar="MODEL=hot|cold",
                   help="record which model is hot and which cold (for the plots)")
    parser.add_argument("--out", default="bench_results.json",
                        help="results JSON to write (default: %(default)s)")


def _register_run(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run", help="send a workload to one server or deployment",
        description="Send a trace-driven workload to an OpenAI-compatible server "
        "(/v1/completions, streaming) and save per-request records and summaries as JSON. "
        "The server is either running already (--url) or started from a deployment file "
        "for this run and stopped after it (--config).",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--config", type=Path, metavar="DEPLOYMENT.yaml",
                       help="start `weaver serve` on this deployment file for the run (its log "
                       "lands beside --out)")
    parser.add_argument("--label", default=None,
                        help="name of this deployment in results and plots (default: the "
                        "deployment file's name with --config, else 'deployment')")
    _add_workload_args(parser)
    _add_client_args(parser)
    parser.set_defaults(handler=_run_handler)


def _register_compare(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "compare", help="the same workload against several deployments, with ratios",
        description="Run the same requests (same seed, same arrival times) against each "
        "deployment in turn, save all runs in one file and print ratios to the first. A "
        "deployment is a YAML file (Weaver starts `weaver serve` on it, runs the workload "
        "and stops it before the next one) or the URL of a running server.",
    )
    _add_target_args(parser)
    _add_workload_args(parser)
    _add_client_args(parser)
    parser.set_defaults(handler=_compare_handler)


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("deployments", nargs="*", type=Path, metavar="DEPLOYMENT.yaml",
                        help="deployment files, labelled by their file name; the first is "
                        "the baseline")
    parser.add_argument("--target", action="append", default=[], metavar="LABEL=URL|YAML",
                        help="a running server or a deployment file with a label; repeat")


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, URL or deployment file) of the positional files, then of each --target."""
    from weaver.bench.compare import parse_target

    targets = [(path.stem, str(path)) for path in args.deployments]
    targets += [parse_target(text) for text in args.target]
    if not targets:
        raise ValueError("give deployment files or --target LABEL=URL|YAML")
    labels = [label for label, _ in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"deployment labels repeat in {labels}; label each --target "
                         "differently or rename the files")
    return targets


GOODPUT_DESCRIPTION = """\
Search each deployment's goodput: the highest request rate at which >= 90 % of the submitted
requests meet the SLO (--ttft-slo-ms and/or --tpot-slo-ms; DistServe's goodput, defined in
weaver/results/goodput.py). Prints and saves each deployment's goodput and its ratio to the
first (the baseline).

how it measures:
  steady state  a run sends --num-requests open-loop arrivals (--arrival) at one rate, or
                rate x --min-span-s where that is more; the first --warmup-requests warm
                the server and are not counted; a request still outstanding --drain-s
                after the last arrival is a miss
  not steady    a run with > 5 % of its counted requests outstanding at that deadline, or
                whose median TTFT kept growing (last third > 2x the first third, and by more
                than max(50 ms, TTFT target / 4), the middle third already a quarter of
                the way up), measured a queue draining; one whose
                counted arrivals spanned < 3x their median lifetime measured a burst that
                the server held at once: either fails whatever its attainment, but a point
                that fails by bursts alone is run again with twice the requests (at most
                --max-span-doublings times), and only the longest runs count
  seeds         a point is one run per workload seed (--seeds, the same for every
                deployment); its attainment is the mean over the seeds, and each seed's own
                goodput gives the spread of the result
  search        from --start-rate, double the rate while points pass (up to --max-rate),
                halve while they fail (down to --min-rate), then bisect until the bracket is
                within --rel-tolerance; --max-points bounds the points per deployment
  interleaving  the deployments are searched together, in rounds of seed 0 of each, then
                seed 1, ..., so slow drift of the machine hits them alike; deployment files
                are therefore all started at once (together they must fit the machine; else
                start them yourself and give --target URLs)

Deployments are YAML files (Weaver starts `weaver serve` on each) or --target LABEL=URL|YAML
(any OpenAI-compatible server). --out is rewritten after every point, so a cut search keeps
what it measured; it opens with the verdict and holds every run's per-request records.
"""


def _register_goodput(commands: argparse._SubParsersAction) -> None:
    from weaver.bench.goodput_search import SearchConfig

    parser = commands.add_parser(
        "goodput", help="search each deployment's goodput (max rate within the SLO), ratios",
        description=GOODPUT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_args(parser)
    _add_workload_args(parser)
    _add_client_args(parser)
    parser.set_defaults(out="goodput_results.json", handler=_goodput_handler)
    g = parser.add_argument_group("search (--rate and --seed are not used: these replace them)")
    g.add_argument("--seeds", type=int, nargs="+", default=list(SearchConfig.seeds),
                   metavar="SEED", help="workload seeds, one run each per point "
                   "(default: %(default)s)")
    g.add_argument("--start-rate", type=float, default=SearchConfig.start_rate,
                   help="first rate tested, req/s (default: %(default)s)")
    g.add_argument("--min-rate", type=float, default=SearchConfig.min_rate,
                   help="halving stops here: failing at it, goodput is 0 (default: "
                   "%(default)s)")
    g.add_argument("--max-rate", type=float, default=SearchConfig.max_rate,
                   help="doubling stops here: passing at it, goodput is at least it "
                   "(default: %(default)s)")
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="first requests of each run not counted (default: 10 %% of "
                   "--num-requests)")
    g.add_argument("--rel-tolerance", type=float, default=SearchConfig.rel_tolerance,
                   help="stop bisecting when (fail - pass) / fail <= this (default: "
                   "%(default)s)")
    g.add_argument("--max-points", type=int, default=SearchConfig.max_points,
                   help="at most this many rates per deployment (default: %(default)s)")
    g.add_argument("--min-span-s", type=float, default=SearchConfig.min_span_s,
                   help="each run's arrivals last at least this long: a run at rate R sends "
                   "max(--num-requests, R x this) requests, so that a fast rate is judged "
                   "over as long a stretch as a slow one (default: %(default)s)")
    g.add_argument("--max-span-doublings", type=int, default=SearchConfig.max_span_doublings,
                   help="a point that fails only because its runs were bursts is run again "
                   "with twice the requests, at most this many times (default: %(default)s)")
    g.add_argument("--drain-s", type=float, default=SearchConfig.drain_s,
                   help="a run's deadline is its last arrival + this (default: %(default)s)")
    g.add_argument("--slo-scale", default=None, metavar="TTFT_X,TPOT_X",
                   help="the SLO as multiples of the judged model's isolated TTFT (at the "
                   "workload's mean prompt) and TPOT, from --isolated-from (a low-load run) "
                   "or --isolated (MuxServe's way), instead of --ttft-slo-ms/--tpot-slo-ms")
    g.add_argument("--judged-model", default=None, metavar="NAME",
                   help="judge each run by this model's requests alone (the other models' "
                   "load is still sent): e.g. a hot model's goodput beside a cold model's "
                   "steady traffic (default: every request)")
    g.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="attainment-vs-rate figure (default: --out with .png)")


def _register_goodput_grid(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "goodput-grid", help="a goodput search's ratios again under a grid of SLOs",
        description="Judge the runs of a `weaver bench goodput` results file again under every "
        "combination of the TTFT and TPOT targets given, and print each deployment's goodput "
        "and ratio to the baseline, so that no single choice of SLO carries a claim. Only "
        "the rates the search tested are there: where a deployment passes at the highest "
        "of them its goodput is a lower bound (>=).",
    )
    parser.add_argument("result", type=Path, help="a `weaver bench goodput` results JSON")
    parser.add_argument("--ttft-slo-ms", type=float, nargs="+", required=True,
                        metavar="MS", help="TTFT targets, in ms")
    parser.add_argument("--tpot-slo-ms", type=float, nargs="+", required=True,
                        metavar="MS", help="TPOT targets, in ms")
    parser.add_argument("--tpot-of", default=None, metavar="MODEL",
                        help="also print MODEL's median TPOT under each deployment over the "
                        "baseline's, per rate, pooled over the seeds (e.g. the cold model "
                        "beside a judged hot one)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the grid as JSON here (it opens with its verdict)")
    parser.set_defaults(handler=_goodput_grid_handler)


def _register_summary(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "summary", help="print tables from saved results",
        description="Print latency/throughput (and SLO) tables from results JSON files; with "
        "--ttft-slo-ms/--tpot-slo-ms also each deployment's goodput per model over a sweep: "
        "the highest rate at which >= 90 %% of the submitted requests met both targets.",
    )
    _add_saved_results_args(
        parser,
        slo_help="TPOT target of the SLO, in ms: with it (or --ttft-slo-ms) each sweep's "
        "goodput is printed",
        percentile_help="TPOT percentile shown",
    )
    parser.add_argument("--ttft-slo-ms", type=float, default=None,
                        help="TTFT target of the SLO, in ms")
    parser.set_defaults(handler=_summary_handler)


def _register_plot(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plot", help="draw figures from saved results",
        description="Write tpot_vs_rate.png (hot and cold model side by side, one line per "
        "deployment) and throughput.png (bars per deployment) from results JSON files.",
    )
    _add_saved_results_args(
        parser,
        slo_help="draw this TPOT SLO as a dashed line, in ms",
        percentile_help="TPOT percentile to plot",
    )
    parser.add_argument("--out-dir", required=True, help="folder for the PNG files")
    parser.set_defaults(handler=_plot_handler)


def _add_saved_results_args(
    parser: argparse.ArgumentParser, slo_help: str, percentile_help: str
) -> None:
    parser.add_argument("results", nargs="+", help="results JSON files")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help=slo_help)
    parser.add_argument("--percentile", type=float, default=90.0,
                        help=f"{percentile_help} (50, 90 or 99; default: 90)")


# Handlers -------------------------------------------------------------------------------


def _guarded(fn):
    """User errors print one line and exit 2, instead of a traceback."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as exc:
            print(f"weaver bench: error: {exc}", file=sys.stderr)
            return 2

    return handler


def _isolated(args: argparse.Namespace):
    from weaver.results.metrics import IsolatedEstimate, fit_isolated
    from weaver.results.records import load_result

    if args.isolated_from:
        result = load_result(args.isolated_from)
        return fit_isolated([rec for run in result.runs for rec in run.records])
    if not args.isolated:
        return None
    out = {}
    for model, value in parse_pairs(args.isolated, "--isolated").items():
        try:
            ttft_ms, tpot_ms = (float(x) for x in value.split(","))
        except ValueError:
            raise ValueError(f"--isolated {model}={value}: expected TTFT_MS,TPOT_MS") from None
        out[model] = IsolatedEstimate(ttft_base_s=ttft_ms / 1000, tpot_s=tpot_ms / 1000)
    return out


def _roles(args: argparse.Namespace) -> dict[str, str]:
    roles = parse_pairs(args.role, "--role")
    bad = {m: r for m, r in roles.items() if r not in ("hot", "cold", "dedicated")}
    if bad:
        raise ValueError(f"--role values must be hot, cold or dedicated; got {bad}")
    return roles


def _workloads(args: argparse.Namespace) -> list[tuple[float | None, list, dict[str, Any]]]:
    """One (rate, requests, description) per swept rate; the trace is read once."""
    builder = _WorkloadBuilder(args)
    rates: list[float | None] = list(args.rate) if args.rate else [None]
    return [builder.build(rate, args.seed) for rate in rates]


class _WorkloadBuilder:
    """The workload of the --model/--trace/... arguments at any rate and seed (a sweep
    varies the rate, a goodput search the rate and the seed); the trace is read once."""

    def __init__(self, args: argparse.Namespace) -> None:
        from weaver.workloads.builder import ModelLoad
        from weaver.workloads.traces import file_sha256, trace_file

        self.args = args
        self.models = [ModelLoad.parse(text) for text in args.model]
        self.source = trace_file(args.trace, args.traces_dir)
        # A missing file is left to load_rows, which says why.
        self.source_sha256 = file_sha256(self.source) if self.source.is_file() else None
        self._rows: list | None = None

    def build(self, rate: float | None, seed: int, num_requests: int | None = None,
              ) -> tuple[float | None, list, dict[str, Any]]:
        """The workload at (rate, seed), of `num_requests` (default --num-requests)."""
        from weaver.workloads.builder import (
            WorkloadSpec,
            build_workload,
            describe_workload,
            load_rows,
            model_rates,
        )
        from weaver.workloads.filters import default_filter_name

        args = self.args
        num_requests = args.num_requests if num_requests is None else num_requests
        spec = WorkloadSpec(
            models=list(self.models), trace=args.trace, rate=rate, arrival=args.arrival,
            burstiness=args.burstiness, num_requests=num_requests,
            length_scale=args.length_scale, max_model_len=_fit_len(args.max_model_len),
            power_law_alpha=args.power_law_alpha, time_scale=args.time_scale,
            filter_name=args.filter_name, seed=seed, traces_dir=args.traces_dir,
        )
        models = spec.models  # copies (NAME=same:OTHER) carry their model's phases there
        per_model = model_rates(spec)  # checks the rates before the trace is read
        if self._rows is None:
            self._rows = load_rows(spec)
        requests = build_workload(spec, self._rows)
        # Offered over the whole run: a phased model's rate over its on/off cycles.
        total = rate if rate is not None else (
            sum(m.mean_rate(r) for m, r in zip(models, per_model, strict=True))
            if per_model else None)
        description = {
            "trace": args.trace, "trace_file": str(self.source),
            "trace_sha256": self.source_sha256,
            "filter": spec.filter_name or default_filter_name(args.trace),
            "arrival": args.arrival,
            "burstiness": args.burstiness, "num_requests": num_requests,
            "length_scale": args.length_scale, "max_model_len": args.max_model_len,
            "power_law_alpha": args.power_law_alpha, "time_scale": args.time_scale,
            "seed": seed, "rate": total,
            "model_rates": (
                {m.name: r for m, r in zip(models, per_model, strict=True)} if per_model else {}
            ),
            "model_phases": {m.name: list(m.phases) for m in models if m.phases is not None},
            "requests": describe_workload(requests),
        }
        return total, requests, description


def _fit_len(max_model_len: int | None) -> int | None:
    if max_model_len is None:
        return None
    if max_model_len <= PROMPT_TOKEN_MARGIN + 1:
        raise ValueError(
            f"--max-model-len must be > {PROMPT_TOKEN_MARGIN + 1}, got {max_model_len}"
        )
    return max_model_len - PROMPT_TOKEN_MARGIN


def _client_config(args: argparse.Namespace, url: str):
    from weaver.bench.loadgen import LoadGenConfig

    return LoadGenConfig(
        base_url=url,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_concurrency=args.max_concurrency,
        duration_s=args.duration_s,
        request_timeout_s=args.request_timeout_s,
        send_vllm_extras=not args.no_vllm_extras,
        show_progress=not args.no_progress,
        scrape_metrics=tuple(args.scrape_metric),
        scrape_interval_s=args.scrape_interval_s,
    )


def _pin_frontend(args: argparse.Namespace) -> None:
    """--frontend-cores, before any server starts (it inherits them); ValueError says what
    is wrong with the cores."""
    from weaver.config.cpu_cores import pin_frontend

    if args.frontend_cores is not None:
        cores = pin_frontend("--frontend-cores", args.frontend_cores)
        if cores is not None:
            print(f"load generator and the servers it starts on cores {sorted(cores)}",
                  flush=True)


def _run_targets(args: argparse.Namespace, targets: list[tuple[str, str]]) -> list:
    from weaver.bench.compare import compare_deployments
    from weaver.bench.report import scraped_table, slo_table, summary_table
    from weaver.results.records import new_result, save_result

    isolated = _isolated(args)
    roles = _roles(args)
    slo = slo_of(args)
    _pin_frontend(args)
    result = new_result(["weaver", *sys.argv[1:]])
    workloads = _workloads(args)
    runs_by_target = []
    for label, where in targets:
        with _served(label, where, args.out) as url:
            config = _client_config(args, url)
            runs = []
            for index, (rate, requests, description) in enumerate(workloads):
                # One server serves every rate of the sweep, and the rates repeat the same
                # request ids: a salt per rate keeps the later rates out of the prefix cache
                # the earlier ones filled. The same rate gets the same salt, so the
                # deployments compared at a rate receive the same prompts.
                (run,) = compare_deployments(
                    [(label, url)], requests, dataclasses.replace(config, prompt_salt=index),
                    rate=rate, workload=description,
                    isolated=isolated, slo=slo,
                )
                run.roles = roles
                _warn_if_all_failed(run)
                runs.append(run)
                result.runs.append(run)
                save_result(result, args.out)  # a cut sweep keeps what it measured
            runs_by_target.append(runs)
    # Rate-major, so that each swept rate lists the deployments side by side.
    result.runs = [runs[i] for i in range(len(workloads)) for runs in runs_by_target]
    save_result(result, args.out)
    print(summary_table(result.runs))
    for table in (slo_table(result.runs), scraped_table(result.runs)):
        if table:
            print(table)
    print(f"results: {args.out}")
    return result.runs


@contextlib.contextmanager
def _served(label: str, where: str, out: Path):
    """The URL of a target: as given, or of a `weaver serve` started on a deployment file
    for the duration of its runs (its log lands beside the results file)."""
    if where.startswith(("http://", "https://")):
        yield where
        return
    from weaver.bench.server_process import weaver_server

    config = Path(where)
    if not config.is_file():
        raise ValueError(f"{where!r} is neither an http:// or https:// URL nor an existing "
                         "deployment file")
    log = Path(out).with_name(f"{Path(out).stem}.{label}.serve.log")
    print(f"starting deployment {label!r} from {config} (log: {log})", flush=True)
    with weaver_server(config, log) as server:
        yield server.base_url


def _warn_if_all_failed(run) -> None:
    errors = [r.error for r in run.records if r.error]
    if errors and not any(r.status.value == "ok" for r in run.records):
        print(f"weaver bench: warning: no request to {run.base_url} succeeded; first error: "
              f"{errors[0]}", file=sys.stderr)


@_guarded
def _run_handler(args: argparse.Namespace) -> int:
    if args.config is not None:
        _run_targets(args, [(args.label or args.config.stem, str(args.config))])
    else:
        _run_targets(args, [(args.label or "deployment", args.url)])
    return 0


@_guarded
def _compare_handler(args: argparse.Namespace) -> int:
    from weaver.bench.report import comparison_table

    targets = _targets(args)
    runs = _run_targets(args, targets)
    for start in range(0, len(runs), len(targets)):  # one table per swept rate
        print(comparison_table(runs[start : start + len(targets)]))
    return 0


@_guarded
def _goodput_handler(args: argparse.Namespace) -> int:
    from weaver.bench.goodput_plot import plot_goodput
    from weaver.bench.goodput_search import SearchConfig, search_goodput, write_report

    targets = _targets(args)
    builder = _WorkloadBuilder(args)
    config = SearchConfig(
        slo=_goodput_slo(args, builder), seeds=tuple(args.seeds), num_requests=args.num_requests,
        warmup_requests=args.warmup_requests, start_rate=args.start_rate,
        min_rate=args.min_rate, max_rate=args.max_rate, rel_tolerance=args.rel_tolerance,
        max_points=args.max_points, drain_s=args.drain_s, judged_model=args.judged_model,
        min_span_s=args.min_span_s, max_span_doublings=args.max_span_doublings,
    )
    if any(model.rate is not None for model in builder.models):
        raise ValueError("goodput searches the total rate: give --model NAME without =RATE "
                         "(--power-law-alpha splits the rate among the models)")
    out = Path(args.out)
    plot = args.plot if args.plot is not None else out.with_suffix(".png")
    command = ["weaver", *sys.argv[1:]]
    _pin_frontend(args)

    def save(outcome) -> None:
        report = outcome.to_json(command)
        write_report(report, out)
        plot_goodput(report, plot)

    with contextlib.ExitStack() as stack:
        # Every deployment is up for the whole search, so that their runs can interleave.
        urls = {label: stack.enter_context(_served(label, where, out))
                for label, where in targets}
        runner = _goodput_runner(args, builder, urls, config)
        outcome = search_goodput(list(urls), runner, config, on_point=save,
                                 show_progress=not args.no_progress)
    save(outcome)
    print(outcome.verdict())
    print(f"results: {out}\nplot: {plot}")
    return 0


def _goodput_grid_handler(args: argparse.Namespace) -> int:
    import json

    from weaver.bench.goodput_search import (
        goodput_grid,
        neighbour_tpot_ratios,
        saved_runs,
        write_report,
    )

    report = json.loads(args.result.read_text(encoding="utf-8"))
    runs = saved_runs(report)
    grid = goodput_grid(report, args.ttft_slo_ms, args.tpot_slo_ms, runs)
    print(grid["verdict"])
    for row in grid["table"]:
        print(row)
    if args.tpot_of is not None:
        ratios = neighbour_tpot_ratios(report, args.tpot_of, runs)
        grid["tpot_of"] = {"model": args.tpot_of, "median_over_baseline": ratios}
        print(f"{args.tpot_of}'s median TPOT over {grid['labels'][0]}'s, per rate (pooled "
              "over the seeds):")
        for label, by_rate in ratios.items():
            print(f"  {label}: " + "; ".join(
                f"{float(rate):.3g} req/s {found['ratio']:.2f}x (n={found['num_requests']})"
                for rate, found in by_rate.items()))
    if args.out is not None:
        print(f"wrote {write_report(grid, args.out)}")
    return 0


def _goodput_slo(args: argparse.Namespace, builder: _WorkloadBuilder):
    if args.rate:
        raise ValueError("goodput searches the rate itself: give --start-rate, --min-rate and "
                         "--max-rate instead of --rate")
    if args.seed != 0:
        raise ValueError("goodput runs every point with each of --seeds; give --seeds, not "
                         "--seed")
    if args.duration_s is not None:
        raise ValueError("goodput sets each run's deadline to its last arrival + --drain-s; "
                         "give --drain-s instead of --duration-s")
    slo = slo_of(args)
    if args.slo_scale is not None:
        if slo is not None:
            raise ValueError("give the SLO either in ms (--ttft-slo-ms/--tpot-slo-ms) or as "
                             "--slo-scale, not both")
        return _scaled_slo(args, builder)
    if slo is None:
        raise ValueError("goodput needs an SLO: give --ttft-slo-ms and/or --tpot-slo-ms, or "
                         "--slo-scale with --isolated-from")
    return slo


def _scaled_slo(args: argparse.Namespace, builder: _WorkloadBuilder):
    """--slo-scale: multiples of the judged model's isolated latencies; its TTFT at the
    workload's mean prompt length."""
    from weaver.results.goodput import Slo

    try:
        ttft_x, tpot_x = (float(x) for x in args.slo_scale.split(","))
    except ValueError:
        raise ValueError(f"--slo-scale {args.slo_scale!r}: expected TTFT_X,TPOT_X, "
                         "e.g. 10,5") from None
    isolated = _isolated(args)
    if args.judged_model is None or isolated is None:
        raise ValueError("--slo-scale needs --judged-model (whose latencies it scales) and "
                         "--isolated-from RESULTS.json (a low-load run) or --isolated")
    if args.judged_model not in isolated:
        raise ValueError(f"no isolated latency of {args.judged_model!r}; have "
                         f"{sorted(isolated)}")
    estimate = isolated[args.judged_model]
    _, requests, _ = builder.build(args.start_rate, args.seeds[0])
    prompts = [r.input_tokens for r in requests if r.model == args.judged_model] or [0]
    ttft = estimate.ttft_base_s + estimate.ttft_per_input_token_s * sum(prompts) / len(prompts)
    return Slo.scaled(ttft, estimate.tpot_s, ttft_x, tpot_x)


def _goodput_runner(args: argparse.Namespace, builder: _WorkloadBuilder,
                    urls: dict[str, str], config):
    """The search's DeploymentRunner: one run_benchmark of the workload at (rate, seed) with
    that many requests."""
    from weaver.bench.runner import run_benchmark

    isolated, roles = _isolated(args), _roles(args)
    workloads: dict[tuple[float, int, int], tuple[list, dict[str, Any]]] = {}

    def run(label: str, rate: float, seed: int, prompt_salt: int, num_requests: int):
        key = rate, seed, num_requests
        if key not in workloads:  # built once, sent to every deployment
            _, requests, description = builder.build(rate, seed, num_requests)
            description["warmup_requests"] = config.warmup_requests
            workloads[key] = requests, description
        requests, description = workloads[key]
        client = dataclasses.replace(
            _client_config(args, urls[label]), prompt_salt=prompt_salt, show_progress=False,
            duration_s=max(r.arrival_s for r in requests) + config.drain_s,
        )
        run = run_benchmark(label, requests, client, rate=rate, workload=description,
                            isolated=isolated, slo=config.slo, roles=roles)
        _warn_if_all_failed(run)
        return run

    return run


@_guarded
def _summary_handler(args: argparse.Namespace) -> int:
    from weaver.bench.plots import load_runs
    from weaver.bench.report import goodput_lines, scraped_table, slo_table, summary_table

    runs = load_runs(args.results)
    print(summary_table(runs))
    for table in (slo_table(runs), scraped_table(runs)):
        if table:
            print(table)
    slo = slo_of(args)
    if slo is not None:
        print("\n".join(goodput_lines(runs, slo)))
    return 0


def slo_of(args: argparse.Namespace):
    """The SLO of --ttft-slo-ms and --tpot-slo-ms, or None when neither is given."""
    from weaver.results.goodput import Slo

    ttft_ms, tpot_ms = getattr(args, "ttft_slo_ms", None), args.tpot_slo_ms
    if ttft_ms is None and tpot_ms is None:
        return None
    return Slo.from_ms(ttft_ms, tpot_ms)


@_guarded
def _plot_handler(args: argparse.Namespace) -> int:
    from weaver.bench.plots import plot_results

    tpot_slo_s = args.tpot_slo_ms / 1000 if args.tpot_slo_ms is not None else None
    for path in plot_results(args.results, args.out_dir, args.percentile, tpot_slo_s):
        print(f"wrote {path}")
    return 0
