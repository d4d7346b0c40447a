"""`weaver config`: show, validate and document deployment files."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show or validate a deployment file",
        description=(
            "Validate a deployment YAML file and print it with every default filled in. "
            "Without a file, print the embedded default deployment that `weaver serve` uses. "
            "A deployment with cuda devices is also checked against this machine's GPUs "
            "(or the ones --gpus names): each device exists, and the engines' memory "
            "budgets fit each GPU. Each engine's vLLM arguments (extra_engine_args, "
            "vllm_flags) are checked by vLLM's own parser."
        ),
    )
    parser.add_argument("config", nargs="?", type=Path, default=None,
                        help="deployment YAML file (default: the embedded default)")
    parser.add_argument("--schema", action="store_true",
                        help="print the JSON schema of deployment files instead")
    parser.add_argument("--engines", action="store_true",
                        help="print what each engine gets instead: its environment and its "
                             "`vllm serve` arguments (models must be prepared or be directories)")
    parser.add_argument("--gpus", type=_gpu_sizes, default=None, metavar="GIB[,GIB...]",
                        help="check against these GPUs (total memory of cuda:0, cuda:1, ... in "
                             "GiB, e.g. 80,80) instead of this machine's; for planning a GPU "
                             "deployment elsewhere")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where prepared models live (default: weaver models' default)")
    parser.set_defaults(handler=run)


def _gpu_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of GiB sizes like 80,80") from None
    if any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: every GPU size must be > 0 GiB")
    return tuple(int(size * (1 << 30)) for size in sizes)


def run(args: argparse.Namespace) -> int:
    import yaml

    from weaver.config.deployment import Deployment, load_deployment
    from weaver.config.devices import GpuInventory

    if args.schema:
        print(json.dumps(Deployment.model_json_schema(), indent=2))
        return 0
    try:
        deployment = load_deployment(args.config)
        gpus = GpuInventory(args.gpus) if args.gpus is not None else None
        if args.engines:
            print(_describe_engines(deployment, gpus, args.models_dir), end="")
            return 0
        _check_devices(deployment, gpus, args.models_dir)
    except ValueError as exc:
        print(exc)
        return 1
    print(yaml.safe_dump(deployment.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _model_dirs(deployment, models_dir: Path | None, *, strict: bool) -> dict[str, Path]:
    """Each model's directory; without `strict`, the unresolvable ones are left out (their
    weights then count as 0 in the budget check, and the check says less)."""
    from weaver.models.registry import resolve_model

    dirs = {}
    for spec in deployment.models:
        try:
            dirs[spec.name] = resolve_model(spec.model, models_dir)
        except ValueError:
            if strict:
                raise
    return dirs


def _check_devices(deployment, gpus, models_dir: Path | None) -> None:
    """Devices and memory budgets, every engine's `vllm serve` arguments through vLLM's own
    parser (extra_engine_args and vllm_flags: a wrong one fails here, not when its engine
    starts), then the plans `weaver serve` makes before any engine starts."""
    from weaver.config.devices import place_engines
    from weaver.server.app import CheckedEngines, check_engine_flags
    from weaver.server.features import planned_engine_configs

    dirs = _model_dirs(deployment, models_dir, strict=False)
    placements = place_engines(deployment, dirs, gpus)
    # A model not prepared here is checked as the directory it names.
    paths = {spec.name: dirs.get(spec.name, Path(spec.model)) for spec in deployment.models}
    check_engine_flags(deployment, CheckedEngines(paths, placements))
    missing = [spec.name for spec in deployment.models if spec.name not in dirs]
    if missing:
        # The plans need each model's shape (its config.json); say what was not checked.
        print(f"# not checked: the weaving, colocation and phase-split plans (models "
              f"{missing} are not prepared here: weaver models prepare NAME, or --models-dir)")
        return
    planned_engine_configs(deployment, dirs)  # what serving would refuse is refused here


def _describe_engines(deployment, gpus, models_dir: Path | None) -> str:
    from weaver.config.devices import place_engines
    from weaver.server.features import planned_engine_configs
    from weaver.vllm_ext.engine.app import engine_cli_args

    dirs = _model_dirs(deployment, models_dir, strict=True)
    placements = place_engines(deployment, dirs, gpus)
    configs = planned_engine_configs(deployment, dirs)
    lines = []
    for spec in deployment.models:
        placement = placements[spec.name]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in placement.environment.items())
        args = engine_cli_args(spec, dirs[spec.name], configs[spec.name], placement)
        lines += [f"# {spec.name}: {spec.role.value} on {spec.device}",
                  f"{env}{' ' if env else ''}vllm serve {shlex.join(args)}", ""]
    return "\n".join(lines)
