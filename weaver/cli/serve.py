"""`weaver serve [CONFIG]`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve every model of a deployment on one OpenAI-compatible endpoint",
        description=(
            "Start one vLLM engine per model of the deployment and serve them all on one "
            "OpenAI-compatible endpoint: GET /v1/models lists them, POST /v1/completions and "
            "/v1/chat/completions (streaming too) route on the request's `model` field, "
            "GET /health reports each engine and GET /metrics exposes Prometheus series "
            "labelled by model. An engine that dies or hangs is restarted (its model answers "
            "503 with Retry-After meanwhile); the first Ctrl-C or SIGTERM drains (in-flight "
            "requests finish, new ones get 503), a second one stops at once. Limits, "
            "deadlines and the restart policy are in the deployment file (README, 'Operating "
            "it')."
        ),
    )
    parser.add_argument(
        "config", nargs="?", type=Path, default=None,
        help="deployment YAML file (default: the embedded two-model deployment; "
        "see `weaver config show`)",
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--api-key", action="append", default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes; repeat for several keys "
        "(default: $WEAVER_API_KEY, or no authentication)",
    )
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where prepared models live (default: $WEAVER_MODELS_DIR or "
                        "~/.cache/weaver/models)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weaver.config.deployment import load_deployment
    from weaver.server.app import ServeSettings, check_engines, serve

    if not 0 < args.port < 65536:
        raise SystemExit(f"--port {args.port} is not a TCP port (1-65535)")
    try:
        deployment = load_deployment(args.config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    env_key = os.environ.get("WEAVER_API_KEY")
    keys = args.api_key or ([env_key] if env_key else [])
    settings = ServeSettings(
        deployment=deployment,
        host=args.host,
        port=args.port,
        api_keys=tuple(keys),
        models_dir=args.models_dir,
        log_level=args.log_level.lower(),
    )
    # A model or device that cannot be had: say so and start nothing.
    try:
        checked = check_engines(settings)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return serve(settings, checked)
