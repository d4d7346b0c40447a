"""`weaver config`: show, validate and document deployment files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show or validate a deployment file",
        description=(
            "Validate a deployment YAML file and print it with every default filled in. "
            "Without a file, print the embedded default deployment that `weaver serve` uses."
        ),
    )
    parser.add_argument("config", nargs="?", type=Path, default=None,
                        help="deployment YAML file (default: the embedded default)")
    parser.add_argument("--schema", action="store_true",
                        help="print the JSON schema of deployment files instead")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from weaver.config.deployment import Deployment, load_deployment

    if args.schema:
        print(json.dumps(Deployment.model_json_schema(), indent=2))
        return 0
    try:
        deployment = load_deployment(args.config)
    except ValueError as exc:
        print(exc)
        return 1
    print(yaml.safe_dump(deployment.model_dump(mode="json"), sort_keys=False), end="")
    return 0
