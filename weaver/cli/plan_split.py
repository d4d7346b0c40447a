"""`weaver plan-split`: compute the cold model's operator split plan from a saved profile.

Profiling a live engine is a separate step; this command reads its JSON
(:mod:`weaver.splitting.profile`), runs Algorithm 1 (:mod:`weaver.splitting.algorithm`),
prints the table and optionally writes the plan that the cold worker applies.
"""

from __future__ import annotations

import argparse
import logging
import sys

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
        "--profile",
        required=True,
        metavar="PROFILE.json",
        help="operator profile written by the cold-side profiler (schema in "
        "weaver/splitting/profile.py)",
    )
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


def run(args: argparse.Namespace) -> int:
    from weaver.splitting.algorithm import plan_split
    from weaver.splitting.profile import SplitProfile
    from weaver.splitting.report import format_report

    try:
        profile = SplitProfile.load(args.profile)
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
