"""`weaver profile --calibrate-weaving PROFILE --deployment FILE`: measure the hot model's
woven steps through `weaver serve` (`weaver.profiling.serving_probe.measure_woven_points`), fit
what they pay beyond the offload cost model and write the calibrated profile
(`weaver.profiling.weaving_calibration`)."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (4, 8, 16)
# Longer than the serving calibration's prompts: the woven overhead is measured at contexts
# like the Azure-conv replay's (about 190 + 60 tokens at --length-scale 0.25).
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_OUTPUT_TOKENS = 48


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "woven-step calibration",
        "With --calibrate-weaving PROFILE --deployment FILE: serve the weaving deployment "
        "FILE as it is (engines pinned by its cpu_cores, the gateway and this client on "
        "--serve-cores, 'engine' meaning the hot model's first core), leave its cold model "
        "idle and measure the TPOT of b requests of the hot model decoding together, for "
        "each --weaving-batch-sizes, twice. The pair's offload ratio places each batch's "
        "sequences as the hot scheduler does; what the served woven step costs beyond "
        "PROFILE's decode step plus the simulator's offload cost is fitted as max(0, a + k "
        "r) over the r remote sequences, and --out gets PROFILE with it (fields "
        "woven_step_*, the points in its notes). PROFILE must be serving-calibrated. About "
        "2 minutes for the benchmark's weaving.yaml, server start included.")
    group.add_argument("--calibrate-weaving", metavar="PROFILE_JSON",
                       help="a serving-calibrated profile of the deployment's hot model")
    group.add_argument("--deployment", metavar="FILE",
                       help="--calibrate-weaving: a deployment with one weaving pair")
    group.add_argument("--weaving-batch-sizes", type=int, nargs="+", metavar="B",
                       default=list(DEFAULT_BATCH_SIZES),
                       help="batch sizes of the woven decode points (their remote counts "
                            "must differ in >= 2 values; default: %(default)s)")
    group.add_argument("--weaving-prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                       metavar="N", help="prompt tokens per request (default: %(default)s)")
    group.add_argument("--weaving-output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS,
                       metavar="N", help="output tokens per request (default: %(default)s)")


def run_calibrate_weaving(args: argparse.Namespace) -> int:
    from weaver.profiling import serving_probe
    from weaver.profiling.serving_calibration import ServingPlan
    from weaver.profiling.weaving_calibration import (
        apply_woven_overhead,
        fit_woven_overhead,
        modelled_woven_step_s,
        num_remote_of,
        require_calibratable,
    )

    try:
        profile, pair, hot, deployment_path = _inputs(args)
        require_calibratable(profile)
        plan = ServingPlan(batch_sizes=tuple(args.weaving_batch_sizes),
                           prompt_tokens=args.weaving_prompt_tokens,
                           output_tokens=args.weaving_output_tokens,
                           block_size=hot["block_size"], max_model_len=hot["max_model_len"])
        remote = {b: num_remote_of(pair.offload_ratio, b) for b in plan.batch_sizes}
        _check_room(plan, remote, hot)
        if len(set(remote.values())) < 2 or min(remote.values()) < 1:
            raise ValueError(f"batch sizes {list(plan.batch_sizes)} at offload ratio "
                             f"{pair.offload_ratio} put {list(remote.values())} sequences "
                             "remote; the fit needs >= 2 distinct counts, none of them 0")
        serve_cores = serving_probe.parse_serve_cores(args.serve_cores,
                                                     str(hot["first_core"]))
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2

    from weaver.sim.perf_model import PerfModel

    perf = PerfModel(profile)
    log_path = Path(tempfile.mkdtemp(prefix="weaver-weaving-probe-")) / "serve.log"
    print(f"woven-step calibration of {args.calibrate_weaving}: {deployment_path}, hot model "
          f"{pair.hot!r} (offload ratio {pair.offload_ratio}), cold model idle; remote "
          f"sequences per batch {remote}; server log {log_path}", flush=True)

    def on_point(point, remark: str) -> None:
        r = remote[point.batch_size]
        base = modelled_woven_step_s(perf, point.batch_size, r, point.mean_context_tokens)
        print(f"  woven decode b={point.batch_size:<3} remote {r:<3} context "
              f"{point.mean_context_tokens:7.0f}  served TPOT {point.tpot_s * 1e3:7.1f} ms  "
              f"modelled {base * 1e3:7.1f} ms  {(point.tpot_s - base) * 1e3:+6.1f} ms  "
              f"({remark})", flush=True)

    started = time.monotonic()
    try:
        points = serving_probe.measure_woven_points(deployment_path, pair.hot, plan, log_path,
                                                    serve_cores, on_point)
        fit = fit_woven_overhead(profile, points, pair.offload_ratio)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        logger.error("woven-step calibration failed: %s", exc)
        return 1
    measured = {"batch_sizes": list(plan.batch_sizes), "prompt_tokens": plan.prompt_tokens,
                "output_tokens": plan.output_tokens, "repeats": plan.decode_repeats}
    cores = "unpinned cores" if serve_cores is None else f"core(s) {sorted(serve_cores)}"
    conditions = (f"weaver serve {deployment_path} (cold model idle), gateway and client on "
                  f"{cores}; plan {json.dumps(measured)}")
    calibrated = apply_woven_overhead(
        profile, fit, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=shlex.join(["weaver", *sys.argv[1:]]), conditions=conditions)
    calibrated.save(args.out)
    added = ", ".join(f"r={r}: {fit.overhead_s(r) * 1e3:.1f} ms"
                      for r in sorted(set(remote.values())))
    print(f"measured in {time.monotonic() - started:.0f} s")
    print(f"woven-step overhead: a = {fit.intercept_s * 1e3:.2f} ms, k = "
          f"{fit.per_remote_seq_s * 1e3:.3f} ms per remote sequence (least squares over "
          f"{len(fit.points)} points); per woven step, clamped >= 0: {added}")
    print(f"profile: {args.out}")
    return 0


def _inputs(args: argparse.Namespace):
    """The profile, the deployment's weaving pair, facts about its hot model, the file."""
    from weaver.cli.calibrate_serving import check_model, load_profile
    from weaver.config.cpu_cores import parse_cpu_cores
    from weaver.config.deployment import load_deployment
    from weaver.profiling.serving_calibration import ServingPlan
    from weaver.sim.deployment import num_usable_blocks
    from weaver.weaving.plan import block_size_of, num_lent_blocks

    if not args.deployment:
        raise ValueError("--calibrate-weaving needs --deployment FILE: the weaving deployment "
                         "to serve")
    path = Path(args.deployment)
    if not path.is_file():
        raise ValueError(f"--deployment {args.deployment!r}: no such file")
    deployment = load_deployment(path)
    if len(deployment.weaving) != 1 or len(deployment.weaving[0].cold) != 1:
        raise ValueError(f"{path}: the calibration serves one weaving pair (one hot, one "
                         f"cold model); it has {len(deployment.weaving)} weaving entries")
    pair = deployment.weaving[0]
    hot_spec, cold_spec = deployment.model(pair.hot), deployment.model(pair.cold[0])
    profile = load_profile(args.calibrate_weaving, "--calibrate-weaving")
    check_model(hot_spec.model, profile)
    cores = parse_cpu_cores(hot_spec.cpu_cores) if hot_spec.cpu_cores else None
    if not cores:
        raise ValueError(f"{path}: give the hot model {pair.hot!r} cpu_cores, so that its "
                         "steps are timed on known cores")
    kv = profile.shape.kv_bytes_per_token
    block_bytes = block_size_of(hot_spec) * kv
    hot = {"block_size": block_size_of(hot_spec),
           "max_model_len": hot_spec.max_model_len or ServingPlan.max_model_len,
           "local_blocks": num_usable_blocks(hot_spec, kv),
           "remote_blocks": num_lent_blocks(deployment, cold_spec, block_bytes),
           "first_core": min(cores)}
    return profile, pair, hot, path


def _check_room(plan, remote: dict[int, int], hot: dict) -> None:
    """Every batch must fit where the ratio puts it, or the scheduler would spill (or
    queue) and the remote counts would not be the ones fitted."""
    per_seq = plan.blocks_per_request()
    for b, r in remote.items():
        if r * per_seq > hot["remote_blocks"] or (b - r) * per_seq > hot["local_blocks"]:
            raise ValueError(
                f"batch {b} ({r} remote, {b - r} local, {per_seq} blocks each) does not fit "
                f"the hot model's {hot['remote_blocks']} remote and {hot['local_blocks']} "
                "local blocks; use smaller batch sizes or shorter requests")
