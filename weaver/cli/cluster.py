"""`weaver cluster {up,down,status}`: a cluster file deployed on a running Ray cluster."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from weaver.cli.command_groups import require_command

logger = logging.getLogger(__name__)

APP_NAME = "weaver"
RAY_MISSING = ("Ray is not installed; multi-node Weaver needs Ray Serve: "
               "pip install -e '.[ray]' (ray[serve]==2.60.0) on every node")  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="deploy a cluster file (node groups, one endpoint) on a Ray cluster",
        description=(
            "Run Weaver across nodes on Ray Serve. Start Ray on each node first (`ray start "
            "--head` on one, `ray start --address HEAD:6379` on the others), then `weaver "
            "cluster up cluster.yaml` from any of them: each group of the file (a deployment "
            "file, written per node by `weaver plan CONFIG --nodes N --cluster DIR`) runs "
            "with `weaver serve` on one node, packed there by a placement group; one "
            "OpenAI-compatible endpoint routes by `model`. Ray Serve restarts a group whose "
            "server dies and routes nothing to it meanwhile."
        ),
    )
    require_command(parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default="auto",
                        help="the Ray cluster to join (default: %(default)s, the one this "
                        "node runs)")  # fmt: skip
    common.add_argument("--name", default=APP_NAME,
                        help="the Ray Serve application's name (default: %(default)s)")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    up = commands.add_parser("up", parents=[common], help="deploy a cluster file",
                             description="Deploy the groups and the ingress of a cluster "
                             "file; returns once every group answers (engines load first: "
                             "minutes), printing the endpoint.")  # fmt: skip
    up.add_argument("file", help="the cluster file (weaver/cluster/spec.py)")
    up.set_defaults(handler=run_up)
    down = commands.add_parser("down", parents=[common], help="stop a deployed cluster file",
                               description="Delete the application: every group's engines "
                               "stop (each `weaver serve` drains first).")  # fmt: skip
    down.set_defaults(handler=run_down)
    status = commands.add_parser("status", parents=[common],
                                 help="the application's groups and their replicas' state")
    status.set_defaults(handler=run_status)


def _connect(address: str) -> Any | None:
    """Join the Ray cluster at `address`; Ray Serve's module, or None (logged) without Ray."""
    try:
        import ray
        from ray import serve
    except ImportError:
        logger.error("%s", RAY_MISSING)
        return None
    ray.init(address=address, namespace=APP_NAME, log_to_driver=False)
    return serve


def run_up(args: argparse.Namespace) -> int:
    from weaver.cluster.spec import load_cluster

    try:
        cluster = load_cluster(args.file)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    serve = _connect(args.address)
    if serve is None:
        return 2
    from weaver.cluster.ray_app import build_app

    spec = cluster.spec
    serve.start(proxy_location=spec.ingress.proxy_location,
                http_options={"host": spec.ingress.host, "port": spec.ingress.port})
    groups = {g.name: (cluster.deployment_texts[g.name], g.resources, g.replicas)
              for g in spec.groups}  # fmt: skip
    start = time.monotonic()
    print(f"deploying {len(groups)} group(s) serving {sorted(cluster.groups_of())}; engines "
          "load first (minutes) ...", flush=True)
    serve.run(build_app(groups, cluster.groups_of()), name=args.name, route_prefix="/")
    print(f"up in {time.monotonic() - start:.0f} s: http://{_shown_host(spec.ingress.host)}:"
          f"{spec.ingress.port}/v1 (every model of {args.file}); stop it with "
          f"`weaver cluster down --name {args.name}`")
    return 0


def run_down(args: argparse.Namespace) -> int:
    serve = _connect(args.address)
    if serve is None:
        return 2
    if args.name not in serve.status().applications:  # delete would raise a traceback
        print(f"no application {args.name!r} on this Ray cluster: nothing to stop")
        return 1
    serve.delete(args.name)
    print(f"application {args.name!r} deleted")
    return 0


def run_status(args: argparse.Namespace) -> int:
    serve = _connect(args.address)
    if serve is None:
        return 2
    app = serve.status().applications.get(args.name)
    if app is None:
        print(f"no application {args.name!r} on this Ray cluster")
        return 1
    print(f"{args.name}: {app.status}")
    for name, deployment in app.deployments.items():
        print(f"  {name}: {deployment.status} {dict(deployment.replica_states)} "
              f"{deployment.message}".rstrip())
    return 0


def _shown_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host
