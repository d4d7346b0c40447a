"""`weaver profile` and `weaver plan-split`: Weaver's measurements, on one driver.

Both commands measure what a plan rests on and write it as JSON, then plan or profile from
the saved file only:
- ``weaver profile`` writes a simulator profile (weaver/sim/PROFILE_FORMAT.md): timed on
  this CPU with random-weight layers (weaver.profiling.torch_layers), on vLLM's own engine
  (``--engine``, weaver/vllm_ext/engine/timing.py), or a GPU's roofline; then calibrates it
  against the serving path (``--calibrate-serving``, ``--calibrate-weaving``);
- ``weaver plan-split`` plans the cold model's operator splits (Algorithm 1,
  weaver.splitting) from a split profile, measured on the engines with ``--measure``
  (weaver/vllm_ext/engine/split_profiler.py).
The pure halves (grids, fits, calibrations, the timer) are in weaver/profiling/; vLLM is
imported only inside the handlers that time it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from weaver.cli import calibrate_serving, calibrate_weaving

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_profile(subparsers)
    _register_plan_split(subparsers)


def _register_profile(subparsers: argparse._SubParsersAction) -> None:
    from weaver.sim.profile import KNOWN_DEVICES, KNOWN_SHAPES

    parser = subparsers.add_parser(
        "profile", help="write a performance profile (measured on CPU, or roofline)",
        description="With --device cpu, time prefill, decode steps and decode attention of "
                    "a random-weight Llama-shaped layer stack in plain torch on this CPU "
                    "(about 10 s for --shape tiny). With a GPU name, write the roofline "
                    "profile from its published specs instead. With --engine MODEL, time "
                    "vLLM's own engine in-process; with --calibrate-serving PROFILE "
                    "--engine MODEL as well, add to that profile the per-step overhead of "
                    "the real serving path, measured through `weaver serve`. The format is "
                    "in weaver/sim/PROFILE_FORMAT.md.")
    parser.add_argument("--device", default="cpu",
                        choices=["cpu", *sorted(KNOWN_DEVICES)],
                        help="cpu measures; a GPU name writes its roofline (default: cpu)")
    parser.add_argument("--shape", default="tiny", choices=sorted(KNOWN_SHAPES),
                        help="model shape (default: %(default)s; measure only tiny or small "
                             "on CPU, the others take long)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--engine", metavar="MODEL",
                        help="time vLLM's own engine serving MODEL (a prepared model name "
                             "or a directory) on one CPU core instead: prefill steps, decode "
                             "steps over batch x context, and the CPU attention kernel the "
                             "cold side runs (about 2-3 minutes for smollm2-135m-instruct); "
                             "with --calibrate-serving: the model to serve")
    parser.add_argument("--cpu-core", type=cpu_cores_arg, default="0", metavar="CORES",
                        help="--engine: the cores to pin the engine to, in a deployment's "
                             "cpu_cores syntax: '0' for one core, '0-1' for two (vLLM then "
                             "runs one compute thread per core, as a colocated group's "
                             "engines do) (default: %(default)s)")
    parser.add_argument("--retime-attention", metavar="PROFILE_JSON",
                        help="with --engine MODEL: time only the offloaded-attention table "
                             "again and write PROFILE_JSON with it to --out, its engine-step "
                             "tables (and any serving calibration) kept; about 30 s")
    calibrate_serving.add_arguments(parser)
    calibrate_weaving.add_arguments(parser)
    parser.set_defaults(handler=run_profile)


def cpu_cores_arg(value: str) -> str:
    """--cpu-core: cores in a deployment's cpu_cores syntax."""
    from weaver.config.cpu_cores import parse_cpu_cores

    try:
        cores = parse_cpu_cores(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not cores:
        raise argparse.ArgumentTypeError(f"{value!r} names no cores; give e.g. 0 or 0-1")
    return value


def _engine_model(args: argparse.Namespace):
    """--engine MODEL's directory and shape (float32, as the engine is timed); ValueError
    if --cpu-core names cores that are not ours."""
    from weaver.config.cpu_cores import own_cpu_cores
    from weaver.models.registry import resolve_model
    from weaver.profiling.engine_profile import shape_from_hf_config

    model_dir = resolve_model(args.engine)
    config = json.loads((model_dir / "config.json").read_text())
    shape = shape_from_hf_config(config, Path(args.engine).name, dtype_bytes=4)
    own_cpu_cores("--cpu-core", args.cpu_core)
    return model_dir, shape


def run_engine_profile(args: argparse.Namespace) -> int:
    """`weaver profile --engine MODEL`: the vLLM import stays in weaver.vllm_ext."""
    from weaver.profiling.engine_profile import EngineGrid, build_profile

    try:
        model_dir, shape = _engine_model(args)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    from weaver.vllm_ext.engine.timing import time_engine

    grid = EngineGrid()
    logger.info("profiling %s on cores %s: %d prefill tokens in all", model_dir,
                args.cpu_core, grid.num_prefill_tokens())
    timings = time_engine(model_dir, shape, grid, args.cpu_core)
    profile = build_profile(grid, shape, timings, device="cpu",
                            memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    profile.save(args.out)
    _print_profile(profile, args.out)
    return 0


def run_retime_attention(args: argparse.Namespace) -> int:
    """`weaver profile --retime-attention PROFILE --engine MODEL`: a new attention table,
    the engine-step tables kept (timed earlier; this machine's speed drifts between runs,
    so re-timing them would move more than the attention)."""
    import datetime

    from weaver.profiling.engine_profile import attention_grid, require_same_shape, with_attention
    from weaver.sim.profile import Profile

    try:
        if not args.engine:
            raise ValueError("--retime-attention needs --engine MODEL: the model the profile "
                             "was measured on")
        profile = Profile.load(args.retime_attention)
        grid = attention_grid(profile)
        _, shape = _engine_model(args)
        require_same_shape(profile, shape)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    from weaver.vllm_ext.engine.timing import attention_note, retime_attention

    old = profile.attention_s
    attention_s, isa = retime_attention(shape, grid, args.cpu_core)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    profile = with_attention(profile, shape, attention_s, attention_note(grid, isa),
                             f"{when} on cores {args.cpu_core}")
    for tokens, before, after in zip(profile.attention_context_tokens, old, attention_s,
                                     strict=True):
        print(f"attention, {tokens:6d} tokens, all layers: {before * 1e3:8.2f} ms -> "
              f"{after * 1e3:8.2f} ms")
    profile.save(args.out)
    _print_profile(profile, args.out)
    return 0


def _print_profile(profile, out: str) -> None:
    print(f"{profile.shape.name} on {profile.device}: prefill({profile.prefill_tokens[-1]} "
          f"tokens)={profile.prefill_s[-1] * 1e3:.2f} ms, decode(batch "
          f"{profile.decode_batch_sizes[0]}, {profile.decode_context_tokens[0]} context)="
          f"{profile.decode_s[0][0] * 1e3:.2f} ms; source: {profile.source}")
    print(f"profile: {out}")


def run_profile(args: argparse.Namespace) -> int:
    from weaver.sim.profile import get_device, get_shape, roofline_profile

    if args.calibrate_serving:
        return calibrate_serving.run_calibrate_serving(args)
    if args.calibrate_weaving:
        return calibrate_weaving.run_calibrate_weaving(args)
    if args.retime_attention:
        return run_retime_attention(args)
    if args.engine:
        return run_engine_profile(args)
    shape = get_shape(args.shape)
    if args.device == "cpu":
        from weaver.profiling.torch_layers import MeasureSettings, measure_cpu_profile

        if args.repeats < 1:
            logger.error("--repeats must be at least 1")
            return 2
        profile = measure_cpu_profile(shape, MeasureSettings(num_repeats=args.repeats))
    else:
        profile = roofline_profile(shape, get_device(args.device))
    profile.save(args.out)
    _print_profile(profile, args.out)
    return 0


def _register_plan_split(subparsers: argparse._SubParsersAction) -> None:
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
    parser.set_defaults(handler=run_plan_split)


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
    from weaver.splitting.measured import MeasureSettings, pair_of
    from weaver.vllm_ext.engine.split_profiler import measure_split_profile

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


def run_plan_split(args: argparse.Namespace) -> int:
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
