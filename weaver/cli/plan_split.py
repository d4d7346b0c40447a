"""`weaver plan-split`: compute the cold model's operator split plan.

From a saved profile (``--profile P``, :mod:`weaver.splitting.profile`), or from a
deployment file: ``weaver plan-split CONFIG --measure`` profiles the cold model and its
hot partner on real engines (weaver/vllm_ext/split_profiler.py) and saves the profile
where ``split: auto`` finds it; ``weaver plan-split CONFIG`` plans from that saved
profile. Either way it runs Algorithm 1 (:mod:`weaver.splitting.algorithm`), prints the
profiled times, the chunks and the expected wait W, and optionally writes the plan.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan-split",
        help="plan how to split the cold model's long operators (Weaver §4.2)",
        description=(
            "Read a cold-model operator profile (JSON), compute the expected wait W of an "
            "offloaded attention task (W = sum T_i^2 / (2 sum T_i)), and split the longest "
            "operators in two until W is under the threshold or no operator is longer than "
            "the hot side's slack K - N. Prints the profiled times, the chunks per operator "
            "and W before/after."
        ),
    )
    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help="deployment file: plan for its cold model from the profile saved for it "
        "(its split_profile, else the default place), or measure one with --measure",
    )
    parser.add_argument(
        "--profile",
        metavar="PROFILE.json",
        help="operator profile written by the cold-side profiler (schema in "
        "weaver/splitting/profile.py); instead of CONFIG",
    )
    parser.add_argument(
        "--cold",
        metavar="NAME",
        help="with CONFIG: which cold model (default: the only one)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with CONFIG: start the cold engine and then its hot partner, measure T_i, "
        "K, N, the hot iteration and the split overhead, and save the profile",
    )
    parser.add_argument("--batch", type=int, default=8,
                        help="--measure: cold decode batch (default: %(default)s)")
    parser.add_argument("--hot-batch", type=int, default=16,
                        help="--measure: hot decode batch, local + remote (default: "
                        "%(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="--measure: prompt tokens per sequence (default: %(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="--measure: tokens decoded per sequence (default: %(default)s)")
    parser.add_argument("--save-profile", metavar="PROFILE.json",
                        help="--measure: where to save the profile (default: where split: "
                        "auto reads it)")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="prepared models (default: weaver's models cache)")
    parser.add_argument(
        "--threshold-frac",
        type=float,
        default=0.05,
        help="stop once W is under this fraction of the hot iteration time "
        "(default: %(default)s, the paper's 5 %%)",
    )
    parser.add_argument(
        "--overhead-us",
        type=float,
        default=None,
        help="cost of one extra chunk in microseconds (default: the profile's measured "
        "split_overhead_s, else 0)",
    )
    parser.add_argument(
        "--statistic",
        choices=["mean", "p50"],
        default="mean",
        help="which profiled time to use per operator (default: %(default)s; W is an "
        "expectation, so the mean is the consistent choice)",
    )
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        metavar="TASKS_PER_S",
        help="offloaded tasks per second when several can queue (adds the M/G/1 term); "
        "default 0: one task at a time",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="PLAN.json",
        help="also write the plan as JSON for the cold worker",
    )
    parser.set_defaults(handler=run)


def _cold_spec(deployment, name: str | None):
    from weaver.config.deployment import Role

    colds = [m for m in deployment.models if m.role is Role.COLD]
    if name is not None:
        matches = [m for m in colds if m.name == name]
        if not matches:
            raise ValueError(f"--cold {name!r} is not a cold model of the deployment; cold "
                             f"models: {[m.name for m in colds]}")
        return matches[0]
    if len(colds) != 1:
        raise ValueError(f"the deployment has {len(colds)} cold models "
                         f"({[m.name for m in colds]}); choose one with --cold")
    return colds[0]


def _measure(args: argparse.Namespace, deployment, spec):
    import asyncio

    from weaver.models.registry import resolve_model
    from weaver.splitting.deploy import profile_path_of
    from weaver.vllm_ext.split_profiler import MeasureSettings, measure_split_profile, pair_of

    settings = MeasureSettings(args.batch, args.hot_batch, args.prompt_len, args.decode_tokens)
    _, hot, _ = pair_of(deployment, spec.name)
    dirs = {m.name: resolve_model(m.model, args.models_dir) for m in (spec, hot)}
    profile = asyncio.run(measure_split_profile(deployment, spec.name, dirs, settings))
    path = Path(args.save_profile) if args.save_profile else profile_path_of(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    print(f"Profile written to {path}")
    return profile


def _load_profile(args: argparse.Namespace):
    from weaver.config.deployment import load_deployment
    from weaver.splitting.deploy import profile_path_of
    from weaver.splitting.profile import SplitProfile

    if (args.profile is None) == (args.config is None):
        raise ValueError("give either a deployment CONFIG or --profile PROFILE.json")
    if args.profile is not None:
        if args.measure:
            raise ValueError("--measure needs a deployment CONFIG, not --profile")
        return SplitProfile.load(args.profile)
    deployment = load_deployment(args.config)
    spec = _cold_spec(deployment, args.cold)
    if args.measure:
        return _measure(args, deployment, spec)
    path = profile_path_of(spec)
    if not path.is_file():
        raise ValueError(f"no profile for cold model {spec.name!r} at {path}; measure one "
                         f"with `weaver plan-split {args.config} --measure`")
    return SplitProfile.load(path)


def run(args: argparse.Namespace) -> int:
    from weaver.splitting.algorithm import plan_split
    from weaver.splitting.report import format_report

    try:
        profile = _load_profile(args)
        if profile.split_overhead_s is None and args.overhead_us is None:
            logger.warning(
                "the profile has no split_overhead_s and --overhead-us is not set: the plan "
                "treats extra chunks as free"
            )
        overhead_s = None if args.overhead_us is None else args.overhead_us * 1e-6
        config = profile.split_config(args.threshold_frac, overhead_s, args.arrival_rate)
        plan = plan_split(profile.operator_specs(args.statistic), config)
    except ValueError as exc:
        print(f"weaver plan-split: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(profile, plan, args.statistic))
    if args.output:
        plan.save(args.output)
        print(f"Plan written to {args.output}")
    return 0
