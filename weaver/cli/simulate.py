"""`weaver simulate` and `weaver plan`: the cluster simulator's commands.

Results are JSON in a folder named after the config (`OUT/CONFIG_NAME/`); plots are drawn
from those saved files afterwards, never from in-memory state.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from weaver.cli.pairs import parse_pairs

if TYPE_CHECKING:
    from weaver.sim.config import SimConfig

logger = logging.getLogger(__name__)

PAPER_HOT_GAIN = 0.60  # Weaver §5: +60 % hot max throughput under the TPOT SLO, A100


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_simulate(subparsers)
    _register_plan(subparsers)


def _config_help() -> str:
    # The folder is listed, not imported: weaver.sim.config loads pydantic, and every
    # `weaver` command builds this help.
    import weaver

    names = sorted(p.stem for p in (Path(weaver.__file__).parent / "sim" / "configs")
                   .glob("*.yaml"))
    return ("a YAML simulation config, or the name of a packaged one (weaver/sim/configs/: "
            f"{', '.join(names)})")


def _register_simulate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a multi-model cluster from a config",
        description="Discrete-event simulation of a cluster serving several LLMs under one "
                    "policy (dedicated, mux_temporal, muxserve, splitwise, weaver). With a "
                    "`sweep:` section it sweeps one model's rate for each listed policy and "
                    "reports its max rate under the SLO. Writes JSON results and PNG plots "
                    "to OUT/CONFIG_NAME/. With --validate, replays every run of a saved "
                    "`weaver bench` result in a simulated copy of its deployment and "
                    "compares mean TPOT and output-token throughput per model.")
    parser.add_argument("config", nargs="?", help=_config_help())
    parser.add_argument("--out", default="results/sim", help="output folder (default: "
                        "%(default)s)")
    parser.add_argument("--policy", help="override the config's policy (single run only)")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--no-sweep", action="store_true",
                        help="run the config once even if it has a sweep section")
    parser.add_argument("--no-plot", action="store_true", help="write JSON only")
    group = parser.add_argument_group("validation against measured runs")
    group.add_argument("--validate", metavar="RESULTS_JSON", nargs="+",
                       help="a `weaver bench` results file to replay instead of a config; "
                            "several files are repeats of the same benchmark command, "
                            "compared by their mean, with the measured runs' spread")
    group.add_argument("--profile", action="append", default=[],
                       metavar="[[LABEL:]MODEL=]PATH",
                       help="measured profile JSON (weaver profile --engine) for every "
                            "model; MODEL=PATH for one model; LABEL:MODEL=PATH for one "
                            "model of one deployment (e.g. a mux group's engines, which "
                            "run on all the group's cores: a profile timed with --cpu-core "
                            "0-1); the most specific wins; repeatable")
    group.add_argument("--deployment", action="append", default=[], metavar="LABEL=PATH",
                       help="deployment file of a run label (default: the .yaml files "
                            "named in the results' command, by file stem)")
    group.add_argument("--mux-contended-speed", type=float, default=1.0, metavar="S",
                       help="mux groups: a step's speed while the group's other engine "
                            "has work, relative to it idle, as measured by "
                            "benchmarks/mux_contention.py (default: %(default)s, no cost)")
    group.add_argument("--metric", action="append", dest="metrics", metavar="NAME",
                       choices=["mean_ttft_s", "mean_tpot_s", "output_tokens_per_s"],
                       help="a per-model number to compare, repeatable: mean_ttft_s, "
                            "mean_tpot_s, output_tokens_per_s (default: the last two)")
    group.add_argument("--tolerance", type=float, default=0.15,
                       help="largest |sim/measured - 1| counted as a match (default: "
                            "%(default)s)")
    parser.set_defaults(handler=run_simulate)


def _register_plan(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="choose model placement, hot/cold pairs and offload ratio",
        description="MuxServe-style enumeration + greedy placement extended with weaving; "
                    "candidates are scored by simulation and compared with the dedicated "
                    "placement. Writes OUT/CONFIG_NAME/plan.json and plan.png.")
    parser.add_argument("config", help=_config_help())
    parser.add_argument("--out", default="results/sim", help="output folder (default: "
                        "%(default)s)")
    parser.add_argument("--no-plot", action="store_true", help="write JSON only")
    parser.add_argument("--deployments", metavar="DIR",
                        help="also write the deployment files `weaver serve` runs: "
                             "DIR/dedicated.yaml (the baseline), DIR/muxserve.yaml (the best "
                             "placement without weaving, its shared devices as mux groups) "
                             "and DIR/weaver.yaml (the best woven one); cpu configs, whose "
                             "models say what to serve (`serve:`); device i is core i")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="with --cluster: split the best woven placement (else the best "
                        "plain one) over N nodes, a weaving pair on one node")
    parser.add_argument("--cluster", metavar="DIR",
                        help="write DIR/cluster.yaml and one deployment per node "
                             "(DIR/node<i>.yaml) for `weaver cluster up`; cpu configs")
    parser.set_defaults(handler=run_plan)


def resolve_config(name_or_path: str):
    from weaver.sim.config import load_config, packaged_configs

    packaged = packaged_configs()
    if not Path(name_or_path).exists() and name_or_path in packaged:
        return load_config(packaged[name_or_path])
    return load_config(name_or_path)


def _write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def run_simulate(args: argparse.Namespace) -> int:
    from weaver.sim import plots
    from weaver.sim.runner import rate_sweep, simulate

    if args.validate:
        return run_validate(args)
    if not args.config:
        logger.error("give a config (or --validate RESULTS_JSON)")
        return 2
    try:
        config = resolve_config(args.config)
        if args.seed is not None:
            config = config.model_copy(update={"seed": args.seed})
        folder = Path(args.out) / config.name
        if config.sweep is not None and not args.no_sweep:
            sweep = rate_sweep(config, progress=True)
            path = _write_json(folder / "sweep.json", sweep)
            _print_sweep(sweep)
            if not args.no_plot:
                print(f"plot: {plots.plot_sweep(path, folder / 'sweep.png')}")
        else:
            result = simulate(config, policy=args.policy, progress=True)
            path = _write_json(folder / f"{result['policy']}.json", result)
            _print_summary(result)
            if not args.no_plot:
                print(f"plot: {plots.plot_run(path, folder / (result['policy'] + '.png'))}")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    print(f"results: {path}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from weaver.config.deployment import load_deployment
    from weaver.results.records import load_result
    from weaver.sim.validate import (
        METRICS,
        deployment_paths_from_command,
        format_goodput,
        format_table,
        validate_results,
    )

    try:
        results = [load_result(path) for path in args.validate]
        paths: dict[str, Path] = {}
        for path, result in zip(args.validate, results, strict=True):
            for label, deployment_path in deployment_paths_from_command(result).items():
                if paths.setdefault(label, deployment_path) != deployment_path:
                    raise ValueError(f"{path} runs {label!r} from {deployment_path}, an "
                                     f"earlier file from {paths[label]}: pass --deployment "
                                     f"{label}=PATH")
        paths.update({k: Path(v) for k, v in parse_pairs(args.deployment, "--deployment").items()})
        labels = {run.label for result in results for run in result.runs}
        deployments = {label: load_deployment(paths[label]) for label in labels
                       if label in paths}
        profiles, label_profiles = _profiles(args.profile, deployments)
        if not 0 < args.mux_contended_speed <= 1:
            raise ValueError(f"--mux-contended-speed {args.mux_contended_speed}: give a "
                             "speed in (0, 1]")
        report = validate_results(results, deployments, profiles, args.tolerance,
                                  label_profiles, args.mux_contended_speed,
                                  args.metrics or METRICS)
        goodput = [_validate_search(path, deployments, profiles, label_profiles, args)
                   for path in args.validate]
        goodput = [g for g in goodput if g is not None]
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    report["results"] = [str(path) for path in args.validate]
    report["deployments"] = {label: str(paths[label]) for label in sorted(deployments)}
    print(format_table(report))
    if goodput:
        report["goodput"] = goodput
        for path, search in zip(args.validate, goodput, strict=False):
            print(format_goodput(search, path))
    stem = Path(args.validate[0]).stem
    if len(args.validate) > 1:
        stem += f"_x{len(args.validate)}"
    path = _write_json(Path(args.out) / f"validate_{stem}.json", report)
    print(f"results: {path}")
    return 0


def _validate_search(path: str, deployments: dict, profiles: dict, label_profiles: dict,
                     args: argparse.Namespace) -> dict | None:
    """A `weaver bench goodput` results file's goodputs, its measured and its simulated
    runs judged by its own judge (`regrade`); None for another kind of results file."""
    from weaver.bench.goodput_search import regrade, saved_runs
    from weaver.results.goodput import Slo
    from weaver.sim.validate import validate_goodput

    report = json.loads(Path(path).read_text())
    if "search" not in report or "points" not in report:
        return None
    slo = Slo.from_ms(**report["search"]["slo"])
    return validate_goodput(report["search"], saved_runs(report),
                            lambda runs: regrade(report, slo, runs), deployments, profiles,
                            args.tolerance, label_profiles, args.mux_contended_speed)


def _profiles(values: list[str], deployments: dict) -> tuple[dict[str, str], dict]:
    """`--profile PATH` for every model, `--profile MODEL=PATH` for one (wins), and
    `--profile LABEL:MODEL=PATH` for one model of one deployment (wins over both)."""
    if not values:
        raise ValueError("--validate needs --profile PATH (from `weaver profile --engine`)")
    shared = [v for v in values if "=" not in v]
    if len(shared) > 1:
        raise ValueError(f"more than one --profile without MODEL=: {shared}")
    names = {name for d in deployments.values() for name in d.served_names}
    profiles = dict.fromkeys(names, shared[0]) if shared else {}
    label_profiles: dict[str, dict[str, str]] = {}
    for key, path in parse_pairs([v for v in values if "=" in v], "--profile").items():
        label, sep, model = key.partition(":")
        if not sep:
            profiles[key] = path
        elif label not in deployments or model not in deployments[label].served_names:
            raise ValueError(f"--profile {key}={path}: no deployment {label!r} with a model "
                             f"{model!r} (deployments: {sorted(deployments)})")
        else:
            label_profiles.setdefault(label, {})[model] = path
    return profiles, label_profiles


def run_plan(args: argparse.Namespace) -> int:
    from weaver.sim import plots
    from weaver.sim.plan_deployment import (
        require_writable,
        weaving_answer,
        write_plan_deployments,
    )
    from weaver.sim.planner import plan_cluster
    from weaver.sim.profile import CPU_DEVICE

    try:
        if (args.nodes is None) != (args.cluster is None):
            raise ValueError("--nodes and --cluster go together: --nodes N --cluster DIR")
        config = resolve_config(args.config)
        writes = bool(args.deployments or args.cluster)
        if writes:  # refuse before minutes of planning, not after
            require_writable(config)
        exclusive = writes and config.cluster.device != CPU_DEVICE
        if exclusive:
            logger.info("planning %s with a GPU per model (no packed GPUs): weaver serve "
                        "runs mux groups on CPU engines only", config.name)
        result = plan_cluster(config, progress=True, exclusive_devices=exclusive)
        written = (write_plan_deployments(config, result, Path(args.deployments))
                   if args.deployments else {})
        if args.cluster:
            written["cluster"] = write_plan_cluster(config, result, args.nodes,
                                                    Path(args.cluster))
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    path = _write_json(Path(args.out) / config.name / "plan.json", result)
    for entry in result["candidates"] + [result["baseline"]]:
        total = entry["summary"]["_all"]
        print(f"{entry['label']:<55} gpus={len(entry['plan']['gpus']):>3} "
              f"pairs={len(entry['plan'].get('pairs', [])):>3} "
              f"tokens={total['output_tokens_per_s']:9.0f}/s "
              f"goodput={total['goodput_rps']:8.2f} req/s "
              f"SLO attainment={total['slo_attainment']:.1%}"
              + _cold_budget_text(entry))
    print(f"chosen: {result['chosen']['label']}; goodput x{result['goodput_gain']:.2f}, token "
          f"throughput x{result['token_throughput_gain']:.2f} vs {result['baseline']['label']}")
    print(weaving_answer(result, config.weaving))
    if not args.no_plot:
        print(f"plot: {plots.plot_plan(path, path.with_suffix('.png'))}")
    for name, deployment in written.items():
        if name == "cluster":
            print(f"cluster file: {deployment}  (deploy it: weaver cluster up {deployment})")
        else:
            print(f"deployment ({name}): {deployment}  (serve it: weaver serve {deployment})")
    print(f"results: {path}")
    return 0


def write_plan_cluster(config: SimConfig, result: dict, num_nodes: int,
                       out_dir: Path) -> Path:
    """The best woven placement (else the best plain one) as a cluster of num_nodes."""
    from weaver.cluster.from_plan import write_cluster
    from weaver.sim.plan import Plan
    from weaver.sim.plan_deployment import best_candidate, mux_mode

    entry = best_candidate(result)
    return write_cluster(config, Plan.from_dict(entry["plan"]), num_nodes, out_dir,
                         mode=mux_mode(entry))


def _print_summary(result: dict) -> None:
    print(f"{result['config']} / {result['policy']}: {result['sim']['num_events']} events, "
          f"{result['sim']['wall_s']:.1f} s wall")
    for model, s in result["summary"].items():
        ttft, tpot = s["ttft_s"]["p90"], s["tpot_s"]["p90"]
        print(f"  {model:<8} done {s['num_completed']}/{s['num_submitted']} "
              f"throughput {s['throughput_rps']:.2f} req/s goodput {s['goodput_rps']:.2f} "
              f"p90 TTFT {_fmt(ttft, 1, 's')} p90 TPOT {_fmt(tpot, 1e3, 'ms')}")


def _fmt(value: float | None, scale: float, unit: str) -> str:
    return "-" if value is None else f"{value * scale:.2f} {unit}"


def _print_sweep(sweep: dict) -> None:
    """One line per policy and rate, the seeds' figures averaged."""
    model = sweep["model"]
    groups: dict[tuple[str, float], list[dict]] = {}
    for p in sweep["points"]:
        groups.setdefault((p["policy"], p["rate"]), []).append(p)

    def mean(values: list[float | None]) -> float | None:
        return None if None in values else sum(values) / len(values)

    for (policy, rate), points in groups.items():
        mine = [p["summary"][model] for p in points]
        others = "  ".join(
            f"{name} p90 TPOT "
            f"{_fmt(mean([p['summary'][name]['tpot_s']['p90'] for p in points]), 1e3, 'ms')}"
            for name in points[0]["summary"] if name not in (model, "_all"))
        attainment = mean([s["slo_attainment"] or 0.0 for s in mine])
        print(f"  {policy:<12} rate {rate:6.2f}  "
              f"{mean([s['output_tokens_per_s'] for s in mine]):7.0f} tok/s  "
              f"mean TPOT {_fmt(mean([s['tpot_s']['mean'] for s in mine]), 1e3, 'ms')}  "
              f"p90 TTFT {_fmt(mean([s['ttft_s']['p90'] for s in mine]), 1, 's')}  "
              f"SLO met {attainment:6.1%}  {others}")
    seeds = sweep.get("seeds", [sweep["seed"]])
    by_seed = sweep.get("by_seed", {})

    def spread(policy: str, key: str) -> str:
        values = by_seed.get(policy, {}).get(key)
        return "" if not values or len(values) < 2 else \
            f" (seeds {min(values):.2f}-{max(values):.2f})"

    rates = sweep["max_rate_rps"]
    print(f"{model} goodput (>= 90 % of requests within TTFT {sweep['slo']['ttft_s']} s and "
          f"TPOT {sweep['slo']['tpot_ms']} ms, at that rate and every lower one; "
          f"{len(seeds)} seeds pooled): "
          + ", ".join(f"{k} {v:.2f} req/s{spread(k, 'goodput_rps')}" for k, v in rates.items()))
    paper = sweep.get("max_rate_mean_tpot_rps")
    if paper:
        print(f"{model} max rate as the paper reads it (mean TPOT <= "
              f"{sweep['slo']['tpot_ms']} ms, TTFT not looked at): "
              + ", ".join(f"{k} {v:.2f} req/s{spread(k, 'mean_tpot_max_rps')}"
                          for k, v in paper.items()))
    for policy, above in sweep.get("above_max_passing", {}).items():
        if above:
            print(f"note: {policy} passes again above its goodput, at "
                  f"{', '.join(f'{r:g}' for r in above)} req/s (not monotone there)")
    if "dedicated" in rates and "weaver" in rates:
        if rates["dedicated"] > 0:
            gain = f"{rates['weaver'] / rates['dedicated'] - 1:+.0%}"
        else:
            gain = "n/a (dedicated meets the SLO at no swept rate; sweep lower rates)"
        print(f"weaving vs dedicated: {gain} (paper, Weaver §5 on A100: "
              f"{PAPER_HOT_GAIN:+.0%})")


def _cold_budget_text(entry: dict) -> str:
    """A woven candidate's cold models' TPOT against the same placement unwoven."""
    from weaver.sim.planner import cold_factors_text

    factors = entry.get("cold_tpot_factors") or {}
    if not factors:
        return ""
    return (f" cold TPOT {cold_factors_text(factors)}"
            + ("" if entry["within_cold_budget"] else " (over budget: not served)"))
