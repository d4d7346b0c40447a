"""`weaver profile --calibrate-serving PROFILE --engine MODEL`: measure the serving path
(`weaver.profiling.serving_probe`), fit the overhead an in-process profile lacks and write the
calibrated profile (`weaver.profiling.serving_calibration`)."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 4, 16, 32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "serving calibration",
        "With --calibrate-serving PROFILE --engine MODEL: start `weaver serve` with MODEL "
        "alone, pinned to --cpu-core, and measure what a streaming client sees: the TPOT of "
        "b requests decoding together for each --serving-batch-sizes, and the TTFT of lone "
        "requests. The difference to PROFILE's in-process times is fitted as a decode "
        "overhead per step, max(0, a + k b), and a fixed prefill overhead; --out gets "
        "PROFILE with them added (same format, the fit and points in its notes). About "
        "3 minutes for smollm2-135m-instruct, server start included.")
    group.add_argument("--calibrate-serving", metavar="PROFILE_JSON",
                       help="an in-process profile (weaver profile --engine) to calibrate")
    group.add_argument("--serving-batch-sizes", type=int, nargs="+", metavar="B",
                       default=list(DEFAULT_BATCH_SIZES),
                       help="batch sizes of the decode points (>= 2 distinct; default: "
                            "%(default)s)")
    group.add_argument("--serving-deployment", metavar="FILE:MODEL",
                       help="serve this deployment file as it is (its engines pinned by "
                            "their cpu_cores, its other models idle) and measure its model "
                            "MODEL (API name) instead of MODEL alone: the fit then also "
                            "holds what the deployment's other engines cost it (--cpu-core "
                            "must be that model's cores)")
    group.add_argument("--serve-cores", default="engine", metavar="engine|all|CORES",
                       help="cores of the gateway/frontend process and of this client: "
                            "'engine' (default) puts them on --cpu-core, so their whole "
                            "cost lands in the step times, as on a machine whose every core "
                            "runs an engine; 'all' leaves them unpinned; or a list like "
                            "'0,1'")


def run_calibrate_serving(args: argparse.Namespace) -> int:
    from weaver.config.cpu_cores import own_cpu_cores
    from weaver.profiling import serving_probe
    from weaver.profiling.serving_calibration import (
        ServingDecodePoint,
        ServingPlan,
        apply_serving_overhead,
        fit_serving_overhead,
        require_in_process,
    )
    from weaver.sim.perf_model import PerfModel

    try:
        if not args.engine:
            raise ValueError("--calibrate-serving needs --engine MODEL: the model the profile "
                             "was measured for")
        profile = load_profile(args.calibrate_serving)
        require_in_process(profile)
        model_dir = check_model(args.engine, profile)
        own_cpu_cores("--cpu-core", args.cpu_core)
        serve_cores = serving_probe.parse_serve_cores(args.serve_cores, args.cpu_core)
        plan = ServingPlan(batch_sizes=tuple(args.serving_batch_sizes))
        deployment = _serving_deployment(args.serving_deployment, args.cpu_core, plan,
                                         profile.shape.kv_bytes_per_token)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2

    perf = PerfModel(profile)
    work_dir = Path(tempfile.mkdtemp(prefix="weaver-serving-probe-"))
    print(f"serving calibration of {args.calibrate_serving}: {model_dir} on cores "
          f"{args.cpu_core}, gateway/frontend and client on "
          f"{_cores_text(serve_cores)}; about {plan.estimate_s(profile):.0f} s of requests "
          f"(in-process estimate) after the server starts; deployment and server log in "
          f"{work_dir}", flush=True)

    def on_point(point, remark: str) -> None:
        if isinstance(point, ServingDecodePoint):
            base = perf.decode_time(point.batch_size, round(point.mean_context_tokens))
            print(f"  decode  b={point.batch_size:<3} context {point.mean_context_tokens:7.0f}"
                  f"  served TPOT {point.tpot_s * 1e3:7.1f} ms  in-process "
                  f"{base * 1e3:7.1f} ms  {(point.tpot_s - base) * 1e3:+6.1f} ms  ({remark})",
                  flush=True)
        else:
            base = perf.prefill_time(point.prompt_tokens)
            print(f"  prefill {point.prompt_tokens:4d} tokens  served TTFT "
                  f"{point.ttft_s * 1e3:7.1f} ms  in-process {base * 1e3:7.1f} ms  "
                  f"{(point.ttft_s - base) * 1e3:+6.1f} ms  ({remark})", flush=True)

    started = time.monotonic()
    try:
        points = serving_probe.measure_serving_points(
            str(model_dir), args.cpu_core, plan, profile.shape.kv_bytes_per_token, work_dir,
            serve_cores, on_point, deployment=deployment)
    except (RuntimeError, TimeoutError) as exc:
        logger.error("serving measurement failed: %s", exc)
        return 1
    try:
        fit = fit_serving_overhead(profile, points.decode, points.prefill)
    except ValueError as exc:  # the points are printed above
        logger.error("cannot fit the serving overhead: %s", exc)
        return 1
    served = (f"one dedicated engine (cpu_cores {args.cpu_core})" if deployment is None
              else f"{deployment[0]} as it is, measuring {deployment[1]!r}, other models idle")
    conditions = (f"weaver serve, {served}, gateway/"
                  f"frontend and client on {_cores_text(serve_cores)}; plan "
                  f"{json.dumps(asdict(plan))}; deployment {points.deployment_path}")
    calibrated = apply_serving_overhead(
        profile, fit, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=shlex.join(["weaver", *sys.argv[1:]]), conditions=conditions)
    calibrated.save(args.out)
    added = ", ".join(f"b={b}: {fit.decode_overhead_s(b) * 1e3:.1f} ms"
                      for b in calibrated.decode_batch_sizes)
    print(f"measured in {time.monotonic() - started:.0f} s")
    print(f"decode overhead per step: a = {fit.intercept_s * 1e3:.2f} ms, k = "
          f"{fit.per_seq_s * 1e3:.3f} ms per sequence (least squares over {len(fit.decode)} "
          f"points); added, clamped >= 0: {added}")
    print(f"prefill overhead per step: {fit.prefill_overhead_s * 1e3:.1f} ms (median of "
          f"{len(fit.prefill)} TTFT - in-process prefill)")
    print(f"profile: {args.out}")
    return 0


def _serving_deployment(value: str | None, cpu_cores: str, plan,
                        kv_bytes_per_token: int) -> tuple[Path, str] | None:
    """--serving-deployment FILE:MODEL, checked: the model is in the file, runs on the cores
    of --cpu-core and has the KV blocks the plan's largest batch needs (or the points would
    queue)."""
    if value is None:
        return None
    from weaver.config.cpu_cores import parse_cpu_cores
    from weaver.config.deployment import load_deployment
    from weaver.sim.deployment import num_usable_blocks
    from weaver.weaving.plan import block_size_of

    path_text, sep, name = value.rpartition(":")
    path = Path(path_text)
    if not sep or not name or not path.is_file():
        raise ValueError(f"--serving-deployment {value!r}: give FILE:MODEL, FILE an existing "
                         "deployment file and MODEL the API name of one of its models")
    deployment = load_deployment(path)
    if name not in {m.name for m in deployment.models}:
        raise ValueError(f"--serving-deployment: {path} has no model {name!r} (it has "
                         f"{[m.name for m in deployment.models]})")
    spec = deployment.model(name)
    cores = parse_cpu_cores(spec.cpu_cores) if spec.cpu_cores else None
    if not cores or cores != parse_cpu_cores(cpu_cores):
        raise ValueError(f"--serving-deployment: {name!r} runs on cpu_cores "
                         f"{spec.cpu_cores!r}, the profile on {cpu_cores!r}; pass --cpu-core "
                         f"{spec.cpu_cores} (and calibrate a profile timed on those cores)")
    # The plan's requests in the deployment's own blocks.
    need = replace(plan, block_size=block_size_of(spec)).kv_blocks()
    have = num_usable_blocks(spec, kv_bytes_per_token)
    if need > have:
        raise ValueError(f"--serving-deployment: {name!r} has {have} KV blocks, the largest "
                         f"batch needs {need}; use smaller --serving-batch-sizes")
    return path, name


def load_profile(path: str, flag: str = "--calibrate-serving"):
    """The profile at `path`, given with `flag` (named in the error if it is missing)."""
    from weaver.sim.profile import Profile

    if not Path(path).is_file():
        raise ValueError(f"{flag} {path!r}: no such profile file")
    return Profile.load(path)


def check_model(engine: str, profile) -> Path:
    """The model directory, after checking that the profile was measured for its shape (a
    calibration against another model's step times would be meaningless)."""
    from weaver.models.registry import resolve_model
    from weaver.profiling.engine_profile import shape_from_hf_config

    model_dir = resolve_model(engine)
    config = json.loads((model_dir / "config.json").read_text())
    shape = shape_from_hf_config(config, profile.shape.name, profile.shape.dtype_bytes)
    differ = [f.name for f in fields(shape) if getattr(shape, f.name)
              != getattr(profile.shape, f.name)]
    if differ:
        raise ValueError(f"{engine} does not have the profile's shape (differs in "
                         f"{', '.join(differ)}); calibrate a profile of this model")
    return model_dir


def _cores_text(cores: set[int] | None) -> str:
    return "unpinned cores" if cores is None else f"core(s) {sorted(cores)}"
